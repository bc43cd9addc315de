"""The order of the engine's collectives, the same on every rank whatever its data did.

Collectives pair up by position: the k-th all-gather of a group on one rank meets the k-th on
every other rank. When ranks run different modules (an MoE expert that got no tokens on one
rank) or produce gradients for different units, an engine that communicates "when a hook fires"
issues different sequences on different ranks, and units pair up with the wrong partners:
wrong weights, no error. The engine therefore follows orders fixed by the model's structure:

* **Reductions** (stages 2/3): trainable units in :func:`reduce_order`; a unit's reduce-scatter
  is launched when it and every unit before it are ready, and at the end of backward the rest
  are launched in that order, with zeros for a unit that got no gradient on this rank (DDP's
  semantics for unused parameters).
* **Stage-3 gathers**: module groups in pre-order during forward and in reverse post-order
  during backward (:class:`GatherCursor`). Asking for a module also gathers every module before
  it that this rank has not reached, and the end of a pass gathers the remaining ones, so each
  module group is gathered once per pass on every rank, in one order. Those caught-up modules
  stay gathered until the pass ends (or, in backward, until their gradients arrive): sibling
  modules (experts of one layer) may run in any order, and one reached later must find its
  parameters without a gather the other ranks would not issue. A rank that truly skipped a
  module therefore holds its parameters for the rest of the pass.
* At stage 3 reductions run on a twin of each sharding group (:func:`twin_groups`), because
  their position relative to the backward gathers depends on when gradients arrive.

A module run again after it was released (called twice in one pass) is gathered again; that is
correct when every rank does it, as in a dense model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from plait.kernels.collectives import group_timeout
from plait.zero_sharding.units import FlatUnit


def reduce_order(model: nn.Module, units: list[FlatUnit]) -> list[FlatUnit]:
    """Trainable units by the registration position of their first parameter, latest first: the
    order backward usually completes them, so launching in it keeps communication overlapped."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    index = {id(u): i for i, u in enumerate(units)}

    def first(unit: FlatUnit) -> int:
        return min(position.get(id(slot.param), len(position)) for slot in unit.slots)

    return sorted((u for u in units if u.trainable), key=lambda u: (-first(u), index[id(u)]))


def module_orders(model: nn.Module, grouped: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(forward, backward)`` orders of the stage-3 module groups: forward pre-hooks fire in
    pre-order, backward pre-hooks in reverse order of forward completion (reverse post-order)."""
    members = {id(m) for m in grouped}
    pre: list[nn.Module] = []
    post: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if id(module) in members:
            pre.append(module)
        for child in module.children():
            visit(child)
        if id(module) in members:
            post.append(module)

    visit(model)
    return pre, post[::-1]


class GatherCursor:
    """One pass (forward or backward) over the module groups in a fixed order.

    Args:
        order: the module groups in the order this pass gathers them.
        units_of: module -> its sharded units.
        catch_up: called with the units of a module this rank has not reached: gather them, so
            every rank issues the same gathers.
        release: called at the end of the pass with every unit caught up in it.
    """

    def __init__(self, order: list[nn.Module], units_of: Callable[[nn.Module], list[FlatUnit]],
                 catch_up: Callable[[list[FlatUnit]], None], release: Callable[[list[FlatUnit]], None]) -> None:
        self.order, self.units_of, self.catch_up, self.release = order, units_of, catch_up, release
        self.index = {id(m): i for i, m in enumerate(order)}
        self.next = 0
        self.active = False
        self.kept: list[FlatUnit] = []

    def start(self) -> None:
        """A pass begins."""
        self.next, self.active, self.kept = 0, True, []

    def _catch_up(self, modules: list[nn.Module]) -> None:
        for module in modules:
            units = self.units_of(module)
            self.catch_up(units)
            self.kept.extend(units)

    def reach(self, module: nn.Module) -> int | None:
        """``module`` is about to run: catch up the modules skipped before it. Returns its
        position in the order (``None`` outside a pass or for a module not in it)."""
        position = self.index.get(id(module))
        if not self.active or position is None:
            return position
        self._catch_up(self.order[self.next:position])
        self.next = max(self.next, position + 1)
        return position

    def ahead(self, position: int, count: int) -> list[nn.Module]:
        """Up to ``count`` modules after ``position`` not yet passed (what prefetch gathers
        next). A module reached out of order prefetches nothing behind the cursor: those were
        gathered when the cursor passed them, and gathering one again would be this rank's alone."""
        start = max(position + 1, self.next)
        return self.order[start:position + 1 + count]

    def finish(self) -> None:
        """The pass ends: catch up every module not reached."""
        if self.active:
            self._catch_up(self.order[self.next:])
            self.release(self.kept)
        self.next, self.active, self.kept = 0, False, []


def twin_groups(units: list[FlatUnit]) -> dict[int, Any]:
    """A second process group with the same ranks for every sharding group of ``units``, keyed
    by ``id(group)``: stage 3 reduces on it, so reductions and backward gathers each keep one
    order however they interleave. Collective over the world (``new_group`` needs every rank):
    the groups of all ranks are exchanged first and created in one sorted order."""
    if not dist.is_initialized() or not units:
        return {}
    mine = {id(u.group): tuple(dist.get_process_group_ranks(u.group)) for u in units}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(set(mine.values())))
    # The job's timeout, not torch's 30-minute default for new groups (a hang must end in time).
    created = {ranks: dist.new_group(list(ranks), timeout=group_timeout())
               for ranks in sorted({r for theirs in everyone for r in theirs})}
    return {key: created[ranks] for key, ranks in mine.items()}
