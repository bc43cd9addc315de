"""1-bit LAMB under ZeRO-1/2 without the post-step parameter all-gather
(``OnebitLambConfig(zero_param_sync="update")``).

Why it is exact. 1-bit Adam's update mode (:mod:`.replicated_update`) works because every rank
decodes the whole synchronised momentum and holds the whole frozen variance, so it can compute each
owner's elementwise update itself. 1-bit LAMB adds per-tensor quantities on top of that elementwise
update: the largest ratio of the frozen to the fresh variance denominator (a maximum, the same
whatever order the pieces come in) and, with weight decay, the norms of the preliminary update and
of the update, which the package sums exactly in integers (:mod:`plait.onebit_optim.rules.lamb`),
so a norm is the same bits whether it is taken from a whole tensor or from pieces on several
ranks. The fresh variance is updated from the averaged gradient recovered from how the
synchronised momentum moved, which every rank can do too if it keeps the last synchronised
momentum. So each rank keeps, per unit, the whole frozen variance, the whole fresh variance and the
last synchronised momentum; it computes the whole unit's update chunk by chunk (one chunk per
owner, each with the same functions on views of the owner's shard length, so the same sequence of
elementwise operations), takes the per-tensor maxima and norms over all chunks without any
communication (gather mode all-reduces them), and applies the result to every shard of its replica.
Parameters, masters and losses equal those of ``zero_param_sync="gather"`` bit for bit (tested).

Costs: per rank 12 bytes per parameter (frozen and fresh variance, last momentum) instead of
``8 / W + 4`` (the gather mode's shards and the exchange's momentum), the two variances
all-gathered once (at the first compressed step and after a load, ``4 P`` bytes each), and the
whole update's arithmetic on every rank. Saved per compressed step: the parameter all-gather
(``4 P`` bytes in fp32) and the per-tensor maximum and norm all-reduces.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.kernels import collectives
from plait.onebit_optim.under_zero.layout import UnitState
from plait.onebit_optim.under_zero.replicated_update import ReplicatedUpdateExchange


def owner_pieces(unit: Any, owner: int) -> list[tuple[int, int, int]]:
    """``(slot index, start, end)`` of every tensor piece in ``owner``'s shard of ``unit``, the
    range relative to the shard (what ``unit.local_pieces()`` gives for this rank's own shard)."""
    lo, hi = owner * unit.shard_numel, (owner + 1) * unit.shard_numel
    out = []
    for index, slot in enumerate(unit.slots):
        start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if end > start:
            out.append((index, start - lo, end - lo))
    return out


class ReplicatedLambExchange(ReplicatedUpdateExchange):
    """1-bit LAMB's ZeRO exchange that is also the engine's parameter gatherer (see the module
    docstring): it keeps what every rank needs to compute the whole update, and hands the inner
    optimizer (:class:`~plait.onebit_optim.under_zero.onebit_lamb.ShardedOnebitLamb`) the other
    owners' chunks through :meth:`other_chunks`.

    Args:
        config: the ``OnebitLambConfig`` (``zero_param_sync="update"``).
        masks: ``{id(parameter): fp32 0/1 mask}`` applied to the exchanged momentum.
    """

    NAME = "OnebitLamb"

    def __init__(self, config: Any, masks: dict[int, torch.Tensor]) -> None:
        super().__init__(config, masks)
        self.fresh: dict[str, torch.Tensor] = {}  # unit key -> whole fresh variance (own chunk unused)
        self.last_momentum: dict[str, torch.Tensor] = {}  # unit key -> last synchronised momentum (whole)
        self._keep_decoded = False

    def _exchange(self, state: UnitState, grads: torch.Tensor, group: Any) -> torch.Tensor | None:
        """As 1-bit Adam's exchange's, keeping the synchronised momentum it decodes first (the last
        step's, which LAMB's fresh variance needs) before it becomes this rank's local momentum."""
        self._keep_decoded = True
        try:
            return super()._exchange(state, grads, group)
        finally:
            self._keep_decoded = False

    def _full_momentum(self, state: UnitState) -> torch.Tensor:
        flat = super()._full_momentum(state)
        if self._keep_decoded:
            self.last_momentum[state.unit.key] = flat.clone()
        return flat

    def prepare(self, key: str, shard_state: dict[str, Any]) -> None:
        """Gather the whole frozen and fresh variances of unit ``key`` if not held yet (first
        compressed step, after a load); call before this step changes the fresh variance shard."""
        state = self.units[key]
        self.whole_variance(state, shard_state["exp_avg_sq"])
        if key not in self.fresh:
            unit = state.unit
            whole = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.device)
            collectives.all_gather_into_tensor(whole, shard_state["exp_avg_sq_fresh"].detach().contiguous(),
                                               group=unit.group,
                                               name=f"{self.NAME} fresh-variance all-gather of `{unit.key}` (once)")
            self.fresh[key] = whole

    def other_chunks(self, key: str) -> list[tuple[int, torch.Tensor, dict[str, Any], torch.Tensor, torch.Tensor]]:
        """Every other owner's chunk of unit ``key``: ``(owner, parameters, state, momentum, last
        momentum)``, views of this rank's replica and of the whole buffers, each the owner's shard
        long; the state holds the frozen and fresh variance and the momentum (as ``exp_avg``).
        Marks the post-step gather as not needed."""
        state = self.units[key]
        unit, shard = state.unit, state.unit.shard_numel
        momentum = self.synchronised_momentum(state)  # the same bits the owners stepped with
        last, variance, fresh = self.last_momentum[key], self.variance[key], self.fresh[key]
        chunks = []
        for owner in range(state.world):
            if owner == state.rank:
                continue
            piece = slice(owner * shard, (owner + 1) * shard)
            chunk_state = {"step": 0, "exp_avg": momentum[piece], "exp_avg_sq": variance[piece],
                           "exp_avg_sq_fresh": fresh[piece]}
            chunks.append((owner, unit.full[piece], chunk_state, momentum[piece], last[piece]))
        self._updated_here = True
        return chunks

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """As 1-bit Adam's update exchange's; the fresh variance is gathered again too."""
        super().load_sharded_state_dict(state)
        self.fresh, self.last_momentum = {}, {}
