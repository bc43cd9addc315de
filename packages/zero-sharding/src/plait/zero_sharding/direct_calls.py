"""Stage 3: a submodule's forward called directly, outside the sharded model's forward.

The engine gathers a module group in that module's forward pre-hook, and the root's units
(embedding, final norm, head) in the sharded model's own forward pre-hook. Code that calls a
submodule itself — ``model.model(input_ids)`` then ``model.lm_head(hidden)``, the pattern of
fused linear + cross-entropy losses and of tiled losses from hidden states — would otherwise
run on released (zero-sized) parameters. Every submodule therefore gets a forward pre-hook and
an always-called forward hook that do nothing inside the model's forward (so ordinary forwards,
their gathers and their prefetch order are unchanged) and, at the outermost direct call, gather
what the module needs that no hook of its own gathers: the units of module groups it sits inside
and the root units holding its parameters.

After the call, under ``torch.no_grad()`` the units gathered here are released at once. With
gradients enabled they stay gathered until the end of the next backward (as the root's units do
in an ordinary step), because autograd saved views of them; the gradients then arrive through the
usual hooks and are reduced like any other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.kernels.eager import eager_only
from plait.zero_sharding.units import FlatUnit


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def needed_units(model: nn.Module, module_units: dict[nn.Module, list[FlatUnit]], root_units: list[FlatUnit],
                 unit_of: dict[int, FlatUnit]) -> dict[nn.Module, list[FlatUnit]]:
    """For every strict submodule of ``model``: the sharded units its direct call must gather
    itself (module groups it is inside, root units holding its parameters), in unit order.

    Args:
        model: the sharded model.
        module_units: module group -> its sharded units.
        root_units: the root's sharded units.
        unit_of: ``id(param)`` -> unit.

    Returns:
        module -> units; modules needing none are left out.
    """
    order = {id(u): i for i, u in enumerate([*root_units, *(u for us in module_units.values() for u in us)])}
    root_ids = {id(u) for u in root_units}
    out: dict[nn.Module, list[FlatUnit]] = {}

    def visit(module: nn.Module, enclosing: list[FlatUnit]) -> None:
        for child in module.children():
            units = {id(u): u for u in enclosing}
            for p in child.parameters():
                unit = unit_of.get(id(p))
                if unit is not None and id(unit) in root_ids:
                    units[id(unit)] = unit
            if units:
                out[child] = sorted(units.values(), key=lambda u: order[id(u)])
            visit(child, [*enclosing, *module_units.get(child, [])])

    visit(model, [])
    return out


class DirectCalls:
    """The hooks described in the module docstring, for one engine.

    Args:
        engine: the stage-3 :class:`~plait.zero_sharding.engine.ZeroEngine`.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.depth = 0  # forwards in progress: the model's, or a directly called submodule's
        self.outer: list[list[FlatUnit]] = []  # per open direct call: the units it gathered
        part = engine.partition
        self.needed = needed_units(engine.model, part.module_units, part.root_units, part.unit_of)

    def register(self) -> list[Any]:
        """Register the hooks; returns their handles."""
        handles = [self.engine.model.register_forward_pre_hook(self._enter_model),
                   self.engine.model.register_forward_hook(self._exit_model, always_call=True)]
        for module in self.engine.model.modules():
            if module is self.engine.model:
                continue
            units = self.needed.get(module, [])
            handles.append(module.register_forward_pre_hook(lambda m, args, units=units: self._enter(units)))
            handles.append(module.register_forward_hook(lambda m, args, out: self._exit(), always_call=True))
        return handles

    def _enter_model(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _exit_model(self, module: nn.Module, args: Any, out: Any) -> None:
        self.depth -= 1

    def _enter(self, units: list[FlatUnit]) -> None:
        # Inside a forward (depth > 1) this hook only counts, in code torch.compile traces, so a
        # compiled block's submodules keep one graph; the outermost call's gathers are not traced.
        self.depth += 1
        if self.depth > 1 or self.engine.pinned:
            self.outer.append([])
            return
        self._enter_outermost(units)

    @eager_only
    def _enter_outermost(self, units: list[FlatUnit]) -> None:
        if _in_backward():
            self.outer.append([])
            return
        fresh = [u for u in units if not u.gathered]
        for unit in fresh:
            unit.gather(self.engine.gatherer, "forward")
        self.outer.append(fresh)

    def _exit(self) -> None:
        self.depth -= 1
        fresh = self.outer.pop()
        if fresh and not torch.is_grad_enabled() and not self.engine.pinned:
            self._release(fresh)

    @eager_only
    def _release(self, fresh: list[FlatUnit]) -> None:
        for unit in fresh:
            unit.release()
