"""Placements per parameter group: a group's ``zero_placement`` keeps its masters and optimizer
state somewhere else than the engine-wide placement.

Typical use: the experts of an MoE model (most of its parameters, each used by few tokens) keep
their fp32 masters and Adam state in host memory or on NVMe (plait-offload-io's placement),
while the dense parameters stay on the compute device::

    zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=2), param_groups=[
        {"params": dense_parameters(model)},
        {"params": expert_parameters(model), "zero_group": groups.edp_group,
         "zero_placement": zero_placement(OffloadConfig(device="nvme", path="/nvme"))},
    ])

:class:`GroupedPlacement` is what the engine then sees: one :class:`StatePlacement` that routes
every call for a unit key to the placement of the key's group, and builds one inner optimizer per
distinct placement (:class:`ComposedOptimizer` steps, saves and loads them as one, its
``param_groups`` in the user's group order, so LR schedulers work unchanged). Each unit's
reduced gradient goes to its own placement's ``grad_device``.

Parameter and gradient offload (a placement's ``shard_storage()`` / ``grad_storage()``) keep
stage-3 shards or gradient shards in one storage for the whole engine, so they stay engine-wide:
a grouped run whose placements offer either is refused, naming the group.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor


class ComposedOptimizer(torch.optim.Optimizer):
    """Several inner optimizers (one per placement) stepped, saved and loaded as one.

    Args:
        optimizers: the inner optimizers, in placement order.
        order: for each user parameter group, ``(optimizer index, group index in it)``.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], order: list[tuple[int, int]]) -> None:
        # Optimizer.__init__ needs a parameter; the real groups and state are the inner ones.
        super().__init__([torch.zeros(1, requires_grad=True)], dict(optimizers[0].defaults))
        self.optimizers, self.order = optimizers, order
        self._link()

    def _link(self) -> None:
        """Point ``param_groups`` and ``state`` at the inner optimizers' (again after a load,
        which replaces the group dicts)."""
        self.param_groups = [self.optimizers[o].param_groups[g] for o, g in self.order]
        self.state = _StateView(self.optimizers)  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step every inner optimizer (parameters without a gradient are left alone by each)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every inner optimizer's gradients."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"optimizers": [each inner optimizer's state_dict()]}``."""
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` returned (same groups and placements).

        Raises:
            ValueError: the saved state has another number of inner optimizers.
        """
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(f"this optimizer composes {len(self.optimizers)} placements' optimizers; the state "
                             f"dict holds {len(saved) if isinstance(saved, list) else 'none'}. Load a state saved "
                             "with the same param_groups and zero_placement settings.")
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)
        self._link()


class _StateView(Mapping):
    """The inner optimizers' ``state`` as one mapping (parameter -> its state)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def _owner(self, param: Any) -> torch.optim.Optimizer:
        for optimizer in self._optimizers:
            if any(p is param for group in optimizer.param_groups for p in group["params"]):
                return optimizer
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        return self._owner(param).state[param]

    def __contains__(self, param: object) -> bool:
        return any(param in optimizer.state for optimizer in self._optimizers)

    def __iter__(self) -> Iterator[Any]:
        for optimizer in self._optimizers:
            yield from optimizer.state

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self._optimizers)


class _MastersView(Mapping):
    """Every placement's masters as one mapping (unit key -> placed master)."""

    def __init__(self, of_key: dict[str, Any]) -> None:
        self._of_key = of_key

    def __getitem__(self, key: str) -> Tensor:
        return self._of_key[key].masters()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._of_key)

    def __len__(self) -> int:
        return len(self._of_key)


class GroupedPlacement:
    """A :class:`~plait.zero_sharding.extension.StatePlacement` routing each unit key to the
    placement of its parameter group (see the module docstring).

    Args:
        group_placements: the placement of each parameter group, in group order.
        group_of_key: unit key -> index of the parameter group the unit belongs to.
    """

    grad_device = None  # per unit: each unit's gradient goes to its own placement's grad_device
    offloads_parameters = False

    def __init__(self, group_placements: list[Any], group_of_key: dict[str, int]) -> None:
        self.group_placements = group_placements
        self.placements: list[Any] = list({id(p): p for p in group_placements}.values())
        self._of_key = {key: group_placements[group] for key, group in group_of_key.items()}

    def place_master(self, key: str, master: Tensor) -> Tensor:
        """Hand the master of ``key`` to its group's placement."""
        return self._of_key[key].place_master(key, master)

    def placement_of(self, key: str) -> Any:
        """The placement holding the master of ``key``."""
        return self._of_key[key]

    def make_optimizer(self, build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                       param_groups: list[dict[str, Any]]) -> ComposedOptimizer:
        """One inner optimizer per placement over its groups, composed in the user's group order.

        Raises:
            ValueError: a placement offers parameter or gradient offload (engine-wide only).
        """
        optimizers, order = [], [(0, 0)] * len(param_groups)
        for index, placement in enumerate(self.placements):
            mine = [i for i, p in enumerate(self.group_placements) if p is placement]
            optimizers.append(placement.make_optimizer(build, [param_groups[i] for i in mine]))
            for position, group in enumerate(mine):
                order[group] = (index, position)
            self._refuse_storage(placement, mine[0])
        return ComposedOptimizer(optimizers, order)

    @staticmethod
    def _refuse_storage(placement: Any, group: int) -> None:
        for offer, setting in (("shard_storage", "param_device"), ("grad_storage", "grad_device='nvme'")):
            if getattr(placement, offer, None) is not None and getattr(placement, offer)() is not None:
                raise ValueError(
                    f"param_groups[{group}]'s placement offers {offer}() ({setting}): parameter and gradient offload "
                    "keep every unit's shards in one storage, so they are engine-wide. Pass that placement as "
                    "zero_shard(placement=...) for every group, or turn that offload off for a per-group placement."
                )

    def step(self, optimizer: ComposedOptimizer, grads: Mapping[str, Tensor],
             ready: Callable[[str], None] | None = None) -> None:
        """Each placement steps its own optimizer on its own keys' gradients."""
        for placement, inner in zip(self.placements, optimizer.optimizers):
            mine = {key: grad for key, grad in grads.items() if self._of_key[key] is placement}
            if not mine:
                continue
            if len(inspect.signature(placement.step).parameters) >= 3:
                placement.step(inner, mine, ready)
            else:
                placement.step(inner, mine)

    def read_master(self, key: str, out: Tensor) -> None:
        """Copy the master of ``key`` (from its placement) into ``out``."""
        self._of_key[key].read_master(key, out)

    def masters(self) -> Mapping[str, Tensor]:
        """key -> placed master, across every placement."""
        return _MastersView(self._of_key)

    def backward_started(self) -> None:
        """Tell every placement that wants to know (e.g. to start reading offloaded state)."""
        for placement in self.placements:
            started = getattr(placement, "backward_started", None)
            if started is not None:
                started()
