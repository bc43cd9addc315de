"""1-bit Adam under ZeRO-1/2 without the post-step parameter all-gather
(``OnebitAdamConfig(zero_param_sync="update")``).

Why it is exact. After warm-up, the 1-bit exchange all-gathers the server signs and scales, so
every rank already holds the synchronised momentum of the whole unit (it decodes it at the next
step anyway). The variance is frozen, the step counter and the hyperparameters are the same on
every rank, and in fp32 compute every rank's replica equals the owners' masters (ZeRO's gather is
exact). So with the whole frozen variance on every rank (all-gathered once, after the floor is
applied at the first compressed step, and again after a checkpoint load), each rank can compute
what each owner computes for its shard. It does so chunk by chunk, calling the same
:func:`~plait.onebit_optim.rules.adam.frozen_variance_update` on a view of the same length as the
owner's master shard, so the elementwise arithmetic is the same sequence of operations and the
results are the same bits: the parameters equal those of ``zero_param_sync="gather"`` bit for bit
(tested), while the post-step all-gather (``b P`` bytes per step) is skipped.

Costs: the whole frozen denominator on every rank (4 bytes per parameter instead of ``4 / W``;
computed once from the whole frozen variance, all-gathered once, ``4 P`` bytes, which it replaces),
and the update's arithmetic over the whole model on every rank. CPU per step is kept down by
decoding the synchronised momentum once per step (the update's decode is handed to the next
step's exchange, which starts from it) and by taking the denominator's square root once.
Only for fp32 compute, where the master shard *is* the replica's shard: with bf16 or fp16
compute the fp32 masters of the other shards are not on this rank (ZeRO's gather already moves
the compute dtype there, 2 bytes per parameter), and an offloaded master is not in the replica;
both are refused at ``zero_shard``, naming the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.kernels import collectives
from plait.onebit_optim.rules.adam import frozen_denominator, frozen_variance_update
from plait.onebit_optim.under_zero.exchange import OnebitZeroExchange
from plait.onebit_optim.under_zero.layout import UnitState


class ReplicatedUpdateExchange(OnebitZeroExchange):
    """1-bit Adam's ZeRO exchange that is also the engine's parameter gatherer: after a compressed
    step every rank has updated its whole replica itself (:func:`update_other_shards`), so the
    post-step all-gather is skipped; every other gather (warm-up steps, loads) is ZeRO's exact one.

    Args:
        config: the ``OnebitAdamConfig`` (``zero_param_sync="update"``; 1-bit LAMB's subclass:
            :mod:`plait.onebit_optim.under_zero.replicated_lamb`).
        masks: ``{id(parameter): fp32 0/1 mask}`` applied to the exchanged momentum.
    """

    def __init__(self, config: Any, masks: dict[int, torch.Tensor]) -> None:
        super().__init__(config, masks)
        self.variance: dict[str, torch.Tensor] = {}  # unit key -> whole frozen variance (padded flat fp32)
        self._updated_here = False  # this step's other shards were updated on this rank
        # unit key -> the synchronised momentum decoded for this step's update, which is also what the
        # next step's exchange starts from: decoded once, not twice.
        self._decoded: dict[str, torch.Tensor] = {}
        # unit key -> ((beta2, eps, freeze step), whole frozen denominator): the variance is frozen, so
        # its square root is taken once instead of every step (in place of the whole variance).
        self._denominators: dict[str, tuple[tuple[float, float, int], torch.Tensor]] = {}

    def bind(self, engine: Any) -> None:
        """As 1-bit Adam's exchange's, and check that every rank can update its whole replica.

        Raises:
            ValueError: another gatherer, a unit whose master is not the replica's own shard (bf16 /
                fp16 compute, an offloaded master), or stage 3; each names the fix.
        """
        super().bind(engine)
        if engine.gatherer is not self or any(unit.gatherer is not None for unit in engine.units):
            raise ValueError(f"{type(self.config).__name__}(zero_param_sync='update') makes the 1-bit exchange "
                             "the parameter gatherer (the post-step all-gather is skipped); drop "
                             "zero_shard(gatherer=...) and param groups' zero_gatherer, or use "
                             "zero_param_sync='gather'.")
        masters = engine.placement.masters()
        for unit in engine.units:
            lo, _ = unit.shard_range
            master = masters[unit.key]
            inside = (unit.resident and master.dtype == torch.float32 and unit.full.dtype == torch.float32
                      and master.device == unit.full.device
                      and master.data_ptr() == unit.full[lo:].data_ptr())
            if not inside:
                raise ValueError(
                    f"{type(self.config).__name__}(zero_param_sync='update'): unit {unit.key!r}'s fp32 master is "
                    "not the shard of this rank's replica (bf16/fp16 compute or an offloaded master), so the "
                    "other shards' masters are not here to update. Use zero_param_sync='gather' (with bf16 "
                    "compute ZeRO's post-step gather already moves 2 bytes per parameter) or fp32 compute "
                    "without offload.")

    def all_gather(self, shard: torch.Tensor, full_out: torch.Tensor, *, group: Any, key: str, phase: str) -> Any:
        """ZeRO's exact all-gather, except the post-step one after a compressed step (phase
        ``"step"``): every rank updated every shard of its replica itself."""
        if phase == "step" and self._updated_here:
            return None
        return collectives.all_gather_into_tensor(full_out, shard, group=group, async_op=True)

    def on_step(self, step: int) -> None:
        """As 1-bit Adam's exchange's; the skip of the post-step gather ends with the step."""
        super().on_step(step)
        self._updated_here = False

    def on_skipped_step(self, step: int) -> None:
        """As 1-bit Adam's exchange's (nothing was updated, so the gather is not skipped)."""
        super().on_skipped_step(step)
        self._updated_here = False
        self._decoded = {}

    def _full_momentum(self, state: UnitState) -> torch.Tensor:
        """As 1-bit Adam's exchange's, but the momentum :meth:`synchronised_momentum` decoded for the
        last update is handed over (the caller changes it in place) instead of decoded again."""
        kept = self._decoded.pop(state.unit.key, None)
        return kept if kept is not None else super()._full_momentum(state)

    def synchronised_momentum(self, state: UnitState) -> torch.Tensor:
        """This step's synchronised momentum of the whole unit (decoded from the exchange's 1-bit
        form, as the owners' shards were), kept for the next step's exchange; read it only."""
        momentum = self._decoded[state.unit.key] = super()._full_momentum(state)
        return momentum

    def whole_variance(self, state: UnitState, shard: torch.Tensor) -> torch.Tensor:
        """The unit's whole frozen variance: all-gathered exactly from the (floored) shards the first
        time it is needed (first compressed step, after a load), then kept."""
        unit = state.unit
        whole = self.variance.get(unit.key)
        if whole is None:
            whole = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.device)
            collectives.all_gather_into_tensor(whole, shard.detach().contiguous(), group=unit.group,
                                               name=f"{self.NAME} frozen-variance all-gather of `{unit.key}` (once)")
            self.variance[unit.key] = whole
        return whole

    def denominator(self, key: str, group: dict[str, Any], shard_state: dict[str, Any]) -> torch.Tensor:
        """Unit ``key``'s whole frozen denominator (:func:`frozen_denominator` of the whole frozen
        variance, gathered once), made once and kept while ``beta2``, ``eps`` and the freeze step stay.

        Args:
            key: the unit.
            group: the unit's optimizer options.
            shard_state: this rank's optimizer state of the unit (its floored ``exp_avg_sq`` shard).
        """
        settings = (group["betas"][1], group["eps"], int(self.freeze_step))
        kept = self._denominators.get(key)
        if kept is None or kept[0] != settings:
            variance = self.whole_variance(self.units[key], shard_state["exp_avg_sq"])
            kept = self._denominators[key] = (settings, frozen_denominator(variance, group, settings[2]))
            del self.variance[key]  # the denominator replaces it (gathered again if the settings change)
        return kept[1]

    def update_other_shards(self, key: str, step_before: torch.Tensor, group: dict[str, Any],
                            shard_state: dict[str, Any]) -> None:
        """Apply this step's update to every shard of unit ``key``'s replica but this rank's own (its
        master, which the inner optimizer has just stepped), as each owner did.

        Args:
            key: the unit.
            step_before: the owner's step counter before this step's increment.
            group: the unit's optimizer options (lr, betas, eps, weight_decay).
            shard_state: this rank's optimizer state of the unit (its floored ``exp_avg_sq`` shard).
        """
        state = self.units[key]
        unit, shard = state.unit, state.unit.shard_numel
        denom = self.denominator(key, group, shard_state)
        momentum = self.synchronised_momentum(state)  # the same bits the owners stepped with
        for owner in range(state.world):
            if owner == state.rank:
                continue
            piece = slice(owner * shard, (owner + 1) * shard)
            chunk_state = {"step": step_before.clone(), "exp_avg": momentum[piece]}
            frozen_variance_update(unit.full[piece], chunk_state, group, self.freeze_step, denom=denom[piece])
        self._updated_here = True

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """As 1-bit Adam's exchange's; the whole variance is gathered again from the loaded shards."""
        super().load_sharded_state_dict(state)
        self.variance, self._decoded, self._denominators = {}, {}, {}
