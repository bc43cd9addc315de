"""0/1 Adam under ZeRO stages 1 and 2: the owner of a shard is the server of each 1-bit exchange,
and the local steps stay local.

``zero_shard(model, ZeroOneAdam, ZeroConfig(stage=1|2), lr=..., onebit_config=ZeroOneAdamConfig(...))``
(or a ``ZeroOneAdam`` instance) builds :class:`ZeroOneZeroExchange`, the engine's reducer *and*
gatherer, and :class:`ShardedZeroOneAdam`, the inner optimizer over the fp32 master shards. Each
step is one of three kinds, decided by the same schedule as :class:`~plait.onebit_optim.ZeroOneAdam`
(``step_kind``):

* **variance step** (variance phase, every ``var_interval``-th step): ZeRO's exact
  reduce-scatter of the gradient, the inner optimizer updates momentum, variance and master
  shard, and ZeRO's exact post-step parameter all-gather follows. Bytes: those of ZeRO + Adam.
* **1-bit step** (the other variance-phase steps): the unit's local gradient bucket goes through
  the worker side of the compressed all-reduce (per-tensor RMS scaling, worker error feedback,
  all-to-all of packed signs); the owner of each shard averages its chunk and recompresses it
  with its server error. Only the owner needs its chunk (the gradient is not kept), so the server
  signs are not all-gathered. The inner optimizer updates momentum and master shard from it; the
  exact parameter all-gather follows.
* **local step** (after ``var_freeze_step``): nothing is exchanged but the engine's 16-byte
  gradient-norm / overflow all-reduce (every rank skips an fp16 step together). Each rank updates
  its own whole copy of every unit with its own gradient, as plain 0/1 Adam does; the post-step
  gather is skipped (this object is the gatherer: ``all_gather`` of phase ``"step"`` is a no-op
  then). Every ``local_step_interval`` steps the parameter change since the last synchronisation
  is exchanged in 1 bit, server signs all-gathered, so every rank decodes the same averaged change:
  parameters ``anchor + change``, momentum ``-change (sqrt(v) + eps) / sum(lr)``, bitwise equal on
  every rank with no parameter gather.

Variance floor (``config.variance_floor``, as plain 0/1 Adam's): on variance and 1-bit steps the
denominator's variance is floored with each tensor's mean summed across the shards (one all-reduce
of ``8 x tensors`` bytes per unit, :mod:`plait.onebit_optim.under_zero.variance_floor`); at the first
local step the gathered whole-unit variance is floored in place, its means taken locally.

Per-rank memory. The variance phase holds what ZeRO + Adam holds (momentum and variance shards)
plus 1-bit Adam's error feedback (worker error: the whole unit in fp32; server error: the shard).
The local-step phase cannot be sharded: every rank steps its whole copy with its own momentum and
the frozen variance, so at the first local step (and after a checkpoint load) the momentum and
variance shards are all-gathered once, exactly, into whole-unit fp32 buffers, and the optimizer's
shards become views of them (no second copy); an fp32 anchor (the last synchronised parameters)
joins them, and with bf16 compute an fp32 copy of the parameters (bf16 cannot hold a local step's
update). The README states the bytes per parameter.

Checkpoints: the pieces of :class:`~plait.onebit_optim.under_zero.exchange.OnebitZeroExchange` (step counter,
error feedback, masks) plus ``ext.onebit.zero_one.counters`` (the two schedules). In the local-step
phase a checkpoint is taken at a synchronisation step, when every rank holds the same parameters
and momentum: between two, each rank's copy is its own and there is no one model to save, so
:meth:`ZeroOneZeroExchange.sharded_state_dict` refuses, naming the next synchronisation step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.sharded_state import ShardedTensor, ShardSpec
from plait.onebit_optim.config import ZeroOneAdamConfig
from plait.onebit_optim.data_parallel.base import run_closure
from plait.onebit_optim.rules.adam01 import resynchronise_, zero_one_update_
from plait.onebit_optim.under_zero.exchange import OnebitZeroExchange
from plait.onebit_optim.under_zero.layout import ShardedInner, UnitState, chunk_of
from plait.onebit_optim.under_zero.variance_floor import floor_nbytes, floor_unit_, floored_shard

VARIANCE, ONEBIT, LOCAL = "variance", "1-bit", "local"


@dataclasses.dataclass
class _LocalBuffers:
    """One unit's whole-unit fp32 buffers of the local-step phase (padded like the unit)."""

    momentum: torch.Tensor  # this rank's own momentum (synchronised at each synchronisation)
    variance: torch.Tensor  # the frozen variance
    anchor: torch.Tensor  # the last synchronised parameters
    params: torch.Tensor  # this rank's parameters: the unit's compute buffer itself when it is fp32


def zero_one_step_nbytes(units: list[tuple[int, int, int]], world: int, kind: str, synchronise: bool = False, *,
                         variance_floor: bool = False) -> int:
    """Logical bytes one 0/1 Adam step under ZeRO records per rank, from ``(numel, shard_numel,
    tensors)`` per unit.

    * variance step: ZeRO's fp32 reduce-scatter (``4 x padded``) + the 16-byte gradient-norm
      all-reduce + the exact fp32 parameter all-gather (``4 x padded``);
    * 1-bit step: per unit the per-tensor RMS all-reduce (``4 x tensors``), the sign all-to-all
      (``W x chunk / 8``) and the worker-scale all-gather (``4 W``), + 16 + the parameter all-gather;
    * local step: 16; a synchronisation adds per unit the RMS all-reduce, sign all-to-all and
      all-gather (``2 x W x chunk / 8``) and both scale all-gathers (``2 x 4 W``).

    With ``variance_floor`` (a non-zero ``ZeroOneAdamConfig.variance_floor``) variance and 1-bit
    steps add per unit the floor's per-tensor mean all-reduce (``8 x tensors``,
    :func:`plait.onebit_optim.under_zero.variance_floor.floor_nbytes`).

    (The first local step, and the first after a load, also all-gathers the momentum and variance
    shards, and with bf16 compute the masters, once: ``4 x padded`` each.)
    """
    total = 16
    for _numel, shard, tensors in units:
        padded, n = world * shard, world * chunk_of(shard)
        if kind == VARIANCE:
            total += 2 * 4 * padded
        elif kind == ONEBIT:
            total += 4 * tensors + n // 8 + 4 * world + 4 * padded
        elif synchronise:
            total += 4 * tensors + 2 * (n // 8) + 2 * 4 * world
        if variance_floor and kind in (VARIANCE, ONEBIT):
            total += floor_nbytes(tensors)
    return total


class ZeroOneZeroExchange(OnebitZeroExchange):
    """The reducer and gatherer of 0/1 Adam under ZeRO (see the module docstring).

    Args:
        config: the :class:`~plait.onebit_optim.ZeroOneAdamConfig`.
        masks: ``{id(parameter): fp32 0/1 mask}`` applied to everything exchanged in 1 bit.
    """

    NAME = "ZeroOneAdam"

    def __init__(self, config: ZeroOneAdamConfig, masks: dict[int, torch.Tensor]) -> None:
        super().__init__(config, masks)  # type: ignore[arg-type]
        # [var_interval, var_counter, local_step_interval, local_step_counter]: a checkpoint piece.
        self.counters = torch.tensor([1, 0, 1, 0], dtype=torch.int64)
        self.local: dict[str, _LocalBuffers] = {}
        self.lr_sums: dict[str, float] = {}
        self._stepped_locally = False  # a local step ran: the post-step gather is skipped until on_step

    # ---- the schedule -------------------------------------------------------------------------
    def step_kind(self) -> str:
        """The kind of the step being taken (1-based ``steps + 1``): variance, 1-bit or local."""
        step = int(self.steps[0]) + 1
        if step > self.config.var_freeze_step:
            return LOCAL
        return VARIANCE if step % int(self.counters[0]) == 0 else ONEBIT

    @property
    def compressing(self) -> bool:
        """Whether the step being taken does not reduce gradients exactly (a 1-bit or local step)."""
        return self.step_kind() != VARIANCE

    def synchronises(self) -> bool:
        """Whether the local step being taken ends with a synchronisation."""
        return (int(self.steps[0]) + 1) % int(self.counters[2]) == 0

    def on_step(self, step: int) -> None:
        """A step was taken: advance the schedule of its kind (as plain 0/1 Adam), then the counter."""
        cfg, counters, kind = self.config, self.counters, self.step_kind()
        if kind == VARIANCE:
            counters[1] += 1
            if int(counters[1]) == cfg.var_update_scaler:
                counters[1] = 0
                counters[0] *= 2
        elif kind == LOCAL:
            counters[3] += 1
            if int(counters[3]) == cfg.local_step_scaler:
                counters[3] = 0
                counters[2] = min(cfg.local_step_clipper, int(counters[2]) * 2)
        self._stepped_locally = False
        super().on_step(step)

    # ---- engine hooks -------------------------------------------------------------------------
    def bind(self, engine: Any) -> None:
        """As 1-bit Adam's, and refuse what would gather over a local step's parameters.

        Raises:
            ValueError: another gatherer (engine-wide or a param group's ``zero_gatherer``), or
                ``ZeroConfig.check_replicas_every`` (local steps make the replicas differ on purpose).
        """
        super().bind(engine)
        if engine.gatherer is not self or any(unit.gatherer is not None for unit in engine.units):
            raise ValueError("ZeroOneAdam under ZeRO gathers parameters itself (its local steps skip the post-step "
                             "all-gather); drop zero_shard(gatherer=...) and param groups' zero_gatherer.")
        if engine.config.check_replicas_every:
            raise ValueError("ZeroConfig.check_replicas_every is set, but ZeroOneAdam's local steps make each rank's "
                             "parameters differ between synchronisations on purpose; drop check_replicas_every.")

    def all_gather(self, shard: torch.Tensor, full_out: torch.Tensor, *, group: Any, key: str, phase: str) -> Any:
        """ZeRO's exact all-gather, except after a local step (phase ``"step"``): each rank keeps the
        whole copy it stepped (or, at a synchronisation, decoded)."""
        if phase == "step" and self._stepped_locally:
            return None
        return collectives.all_gather_into_tensor(full_out, shard, group=group, async_op=True)

    def reduce_scatter(self, full: torch.Tensor, shard_out: torch.Tensor, *, group: Any, key: str) -> Any:
        """Variance and 1-bit steps as 1-bit Adam's exchange (exact, or 1-bit); a local step keeps the
        local gradient bucket for the step (``shard_out`` gets zeros)."""
        if self.step_kind() != LOCAL:
            return super().reduce_scatter(full, shard_out, group=group, key=key)
        self._claim(key)
        self._keep(full, shard_out, group, key)
        return None

    def clip_requested(self, max_norm: float) -> None:
        """Variance steps: the engine clips. 1-bit steps: as 1-bit Adam (needs deferral). Local steps:
        each rank clips its own gradient by its own norm (local steps do not communicate)."""
        if self.step_kind() == LOCAL:
            self._clip_request = max_norm
            return
        super().clip_requested(max_norm)

    def run_deferred(self) -> None:
        """Deferred 1-bit steps exchange here; a local step's gradients are taken by :meth:`local_step`."""
        if self.step_kind() != LOCAL:
            super().run_deferred()

    def _gather_momentum(self, state: UnitState) -> None:
        """0/1 Adam keeps no momentum in 1 bit: nothing to gather."""

    # ---- 1-bit steps: the gradient ------------------------------------------------------------
    def _exchange(self, state: UnitState, grads: torch.Tensor, group: Any) -> torch.Tensor | None:
        """The unit's 1-bit gradient exchange; returns the owner's averaged gradient shard, or
        ``None`` (errors untouched) when some rank's gradient is not finite."""
        if state.world == 1:  # the average of one value is the value
            if not bool(torch.isfinite(grads).all()):
                return None
            return self._own_shard(state, grads[:state.shard], [1.0] * len(state.unit.slots))
        scaled = self._scaled_buffer(state, grads, group)
        if scaled is None:
            return None
        buffer, factors = scaled
        _, _, own = self._compressed_allreduce(state, buffer, group, state.unit.key, gather=False)
        return self._own_shard(state, own, factors)

    # ---- local steps ------------------------------------------------------------------------------
    def local_step(self) -> None:
        """One local step of every unit (called by the inner optimizer), with the synchronisation
        when it is due (plain :class:`~plait.onebit_optim.ZeroOneAdam`'s arithmetic, per unit)."""
        if not self.local:
            self._enter_local(fresh=int(self.steps[0]) == self.config.var_freeze_step)
        grads = self._local_grads()
        self._stepped_locally = True
        synchronise = self.synchronises()
        masters = self.engine.placement.masters()
        for key, state in self.units.items():
            grad = grads.get(key)
            if grad is None:
                continue
            unit, buffers = state.unit, self.local[key]
            group = self.optimizer.param_groups[unit.option_index]
            zero_one_update_(buffers.params, grad, buffers.momentum, buffers.variance, group, variance=False)
            self.lr_sums[key] = self.lr_sums.get(key, 0.0) + group["lr"]
            if synchronise:
                change = self._average_change(state, buffers.params - buffers.anchor)
                resynchronise_(buffers.params, buffers.momentum, buffers.variance, buffers.anchor, change,
                               group["eps"], self.lr_sums[key])
                self.lr_sums[key] = 0.0
            if buffers.params is not unit.full:  # bf16 compute: the fp32 copy is the truth
                lo, hi = unit.shard_range
                unit.full.copy_(buffers.params)
                masters[key].data.copy_(buffers.params[lo:hi])
            self.optimizer.state[masters[key]]["step"] += 1

    def _enter_local(self, *, fresh: bool) -> None:
        """Build the whole-unit buffers from the shards (exact all-gathers, once); ``fresh`` (the
        first local step) also zeroes the error feedback, which held gradient errors and now
        carries those of the exchanged parameter change."""
        masters = self.engine.placement.masters()
        for key, state in self.units.items():
            unit = state.unit
            if fresh:
                state.worker_error.zero_()
                state.server_error.zero_()
            inner = self.optimizer.state[masters[key]]
            momentum, variance = self._gathered(unit, inner["exp_avg"]), self._gathered(unit, inner["exp_avg_sq"])
            params = unit.full if unit.full.dtype == torch.float32 else self._gathered(unit, masters[key].detach())
            lo, hi = unit.shard_range
            if fresh:  # frozen from here on: floored once, in place (the whole unit is here: no all-reduce)
                floor_unit_(unit, variance, self.config.variance_floor)
            inner["exp_avg"], inner["exp_avg_sq"] = momentum[lo:hi], variance[lo:hi]  # views: no second copy
            self.local[key] = _LocalBuffers(momentum, variance, params.detach().clone(), params)

    def _gathered(self, unit: Any, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.device)
        collectives.all_gather_into_tensor(full, shard.detach().to(torch.float32).contiguous(), group=unit.group,
                                           name=f"ZeroOneAdam local-phase all-gather of `{unit.key}` (once)")
        return full

    def _local_grads(self) -> dict[str, torch.Tensor]:
        """This rank's kept gradient buckets, fp32, unscaled, clipped by this rank's own norm when
        ``max_grad_norm`` or ``clip_grad_norm_`` asks (no communication)."""
        kept, self._kept = self._kept, {}
        limit, self._clip_request = self._clip_request or self.max_grad_norm, None
        scale = float(getattr(getattr(self.engine.model, "zero_optimizer", None), "loss_scale", 1.0))
        coefficient = 1.0 / scale
        if limit is not None and kept:
            squares = sum(float(torch.linalg.vector_norm(full, dtype=torch.float32)) ** 2 for full, _ in kept.values())
            self.last_grad_norm = math.sqrt(squares) / scale
            if self.last_grad_norm > limit:
                coefficient *= limit / (self.last_grad_norm + 1e-6)
        out = {}
        for key, (full, _) in kept.items():
            grad = full.to(torch.float32)
            out[key] = grad * coefficient if coefficient != 1.0 else grad  # never in place: stage 1's buffer
        return out

    def _average_change(self, state: UnitState, change: torch.Tensor) -> torch.Tensor:
        """The 1-bit average of a unit's parameter change, decoded whole on every rank, masked.

        Raises:
            FloatingPointError: some rank's change is not finite (its local steps diverged).
        """
        unit = state.unit
        if state.world == 1:  # the average of one value is the value
            averaged = change
            for slot in unit.slots:
                mask = self.masks.get(id(slot.param))
                if mask is not None:
                    averaged[slot.offset:slot.offset + slot.numel].mul_(mask.reshape(-1))
        else:
            scaled = self._scaled_buffer(state, change, unit.group)
            if scaled is None:
                raise FloatingPointError(f"ZeroOneAdam under ZeRO: a rank's local steps left a non-finite parameter "
                                         f"change in unit `{unit.key}`; lower the learning rate or local_step_clipper.")
            buffer, factors = scaled
            signs, scales, _ = self._compressed_allreduce(state, buffer, unit.group, unit.key)
            state.signs, state.scales, state.factors = signs, scales, factors
            averaged = self._full_momentum(state)
        state.signs = state.scales = None
        state.factors = []
        return averaged

    # ---- checkpoints ----------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """1-bit Adam's pieces plus ``ext.onebit.zero_one.counters``.

        Raises:
            RuntimeError: in the local-step phase between two synchronisations.
        """
        if any(self.lr_sums.values()):
            interval = int(self.counters[2])
            due = (int(self.steps[0]) // interval + 1) * interval
            raise RuntimeError(
                f"ZeroOneAdam under ZeRO: step {int(self.steps[0])} is a local step between synchronisations, where "
                f"each rank's parameters are its own; save after a synchronisation step (the next is step {due}: "
                "steps divisible by the local-step interval).")
        everyone = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
        out = super().sharded_state_dict()
        name = "ext.onebit.zero_one.counters"
        out[name] = ShardedTensor(ShardSpec.full(name, self.counters, kind="other", replica_ranks=everyone),
                                  self.counters)
        return out

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """As 1-bit Adam's; the local-phase buffers are rebuilt from the loaded shards at the next
        local step."""
        super().load_sharded_state_dict(state)
        self.local = {}
        self.lr_sums = {}


class ShardedZeroOneAdam(ShardedInner):
    """The inner optimizer of 0/1 Adam under ZeRO, over the fp32 master shards (see the module
    docstring). ``zero_shard`` builds it through
    :func:`plait.onebit_optim.under_zero.compose.compose_with_zero`; it is not meant to be built by hand.
    """

    EXCHANGE: ZeroOneZeroExchange  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of the current kind: a local step of the whole units, or an update of the master
        shards from the exact (variance step) or 1-bit (1-bit step) averaged gradient."""
        loss = run_closure(closure)
        exchange = self.exchange
        kind = exchange.step_kind()
        if kind == LOCAL and exchange.engine is not None:
            exchange.local_step()
            return loss
        exchange.run_deferred()
        keys = {id(m): k for k, m in exchange.engine.placement.masters().items()} if exchange.engine else {}
        for group in self.param_groups:
            for p in group["params"]:
                averaged = exchange.take_momentum(keys.get(id(p), "")) if kind == ONEBIT else None
                grad = averaged if averaged is not None else p.grad  # p.grad: the exact average (or a zero
                if grad is None:                                     # gradient creating the state)
                    continue
                state = self._state(p)
                state["step"] += 1
                unit = exchange.units[keys[id(p)]].unit if exchange.engine else None
                zero_one_update_(p, grad, state["exp_avg"], state["exp_avg_sq"], group, variance=kind == VARIANCE,
                                 floor=self._floor(unit))
        return loss

    def _floor(self, unit: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """The variance floor of a master shard of ``unit``: each tensor's mean taken across the
        shards (one small all-reduce per unit and step); the identity without a floor."""
        ratio = self.config.variance_floor
        if not ratio or unit is None:
            return lambda v: v
        return lambda v: floored_shard(unit, v, ratio, name="ZeroOneAdam")

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        return state
