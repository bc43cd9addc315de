"""ZeroOptimizer: the optimizer the user steps, over this rank's fp32 master shards.

It is a real ``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` are the inner
optimizer's (the user's optimizer class built over the master shards), so LR schedulers and
code reading ``param_groups`` work unchanged. ``step()`` does, on every rank in the same order:

1. finish gradient reduction (wait for backward's reduce-scatters, reduce anything local);
2. turn reduced sums into fp32 averages, unscale (fp16);
3. one all-reduce of ``[sum of squares, overflow flag]`` over the world: the global gradient
   norm across all shards and the decision to skip, identical on every rank;
4. skip (every rank together, nothing touched, loss scale backs off) or clip and step;
5. refresh the compute parameters from the masters (all-gather for resident units).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.zero_sharding import profiling
from plait.zero_sharding.composition import notify
from plait.zero_sharding.engine import ZeroEngine
from plait.zero_sharding.extension import wait
from plait.zero_sharding.grad_norm import shard_sumsq
from plait.zero_sharding.grad_stash import StashedGrad
from plait.zero_sharding.loss_scaler import LossScaler
from plait.zero_sharding.replicas import check_replicas
from plait.zero_sharding.tensor_parallel import weighted_sumsq

# Post-step all-gathers in flight at once (see ZeroOptimizer.step).
MAX_PENDING_GATHER = 2


class ZeroOptimizer(torch.optim.Optimizer):
    """See the module docstring.

    Args:
        engine: the model's engine.
        inner: the user's optimizer over the master shards (built by the placement).
        scaler: the loss scaler.
    """

    def __init__(self, engine: ZeroEngine, inner: torch.optim.Optimizer, scaler: LossScaler) -> None:
        # Optimizer.__init__ needs a parameter; the real groups are swapped in right after so
        # schedulers and hooks see exactly the inner optimizer's dicts.
        super().__init__([torch.zeros(1, requires_grad=True)], dict(inner.defaults))
        self.engine, self.inner, self.scaler = engine, inner, scaler
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.steps_taken = 0
        self.last_grad_norm: float | None = None
        self.last_breakdown: profiling.StepBreakdown | None = None
        self._clip_request: float | None = None
        self._cached: tuple[dict[str, torch.Tensor], float, bool] | None = None  # from clip_grad_norm_
        # Keys of the gradients _averaged_grads made (or was allowed to spend, see
        # step_then_zero_grad): clipping scales those in place instead of copying the shard again.
        self._owned: set[str] = set()
        self._spend_grads = False
        self._takes_ready = len(inspect.signature(engine.placement.step).parameters) >= 3

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step (see the module docstring). Returns the closure's loss, if any.

        Raises:
            ReplicaMismatchError: ``check_replicas_every`` is set and replicated state differs.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine, config = self.engine, self.engine.config
        with profiling.range_("step"):
            if config.check_replicas_every and self.steps_taken % config.check_replicas_every == 0:
                check_replicas(engine, self.scaler)
            grads, sumsq, overflow = self._cached or self._averaged_grads()
            self._cached = None
            if overflow:
                self._skip()
                return loss
            self.last_grad_norm = math.sqrt(sumsq)
            max_norm = self._clip_request or config.max_grad_norm
            self._clip_request = None
            if max_norm is not None and self.last_grad_norm > max_norm:
                coef = max_norm / (self.last_grad_norm + 1e-6)
                # Out of place: a gradient may be the unit's grad_shard itself (see _averaged_grads),
                # which must keep the unclipped sum (accumulation without zero_grad).
                grads = {key: grad.mul_(coef) if key in self._owned else grad * coef
                         for key, grad in grads.items()}
            writes = _ShardWrites()
            with profiling.optimizer_range():
                refreshed = self._placement_step(grads, writes)
            gathers: list[Any] = []
            for unit in engine.units:
                if unit.key not in refreshed:
                    unit.load_from_master(engine.placement)
                    writes.started(unit)
                # In flight while the next unit's shard is refreshed; at most two at once, which
                # bounds the collective layer's own buffers to two units.
                gathers.append(unit.regather(engine.gatherer, block=False))
                if len(gathers) > MAX_PENDING_GATHER:
                    _wait_gather(gathers.pop(0))
                if config.stage == 1:
                    unit.grad_shard = None  # stage 1 re-reduces its full buffer each step
            for handle in gathers:
                _wait_gather(handle)
            self.scaler.update(False)
            self.steps_taken += 1
            notify(engine, "on_step", self.steps_taken)
            self.last_breakdown = profiling.close_step()
            # Last: the step is complete in memory; a shard that could not be written stays in
            # memory and is written by the next step (raised on every rank together).
            engine.settle_shards()
        return loss

    def _placement_step(self, grads: dict[str, torch.Tensor], writes: _ShardWrites) -> set[str]:
        """Run the placement's step; returns the keys whose compute shards it already refreshed
        through the optional ``ready`` callback (see :class:`~plait.zero_sharding.extension.StatePlacement`)."""
        placement = self.engine.placement
        if not self._takes_ready:
            placement.step(self.inner, grads)
            return set()
        units = {unit.key: unit for unit in self.engine.units}
        refreshed: set[str] = set()

        def ready(key: str) -> None:
            units[key].load_from_master(placement)
            writes.started(units[key])
            refreshed.add(key)

        placement.step(self.inner, grads, ready)
        return refreshed

    def _averaged_grads(self) -> tuple[dict[str, torch.Tensor], float, bool]:
        """fp32 averaged gradient shards, the global squared norm and the agreed overflow flag."""
        engine = self.engine
        engine.finish_gradients()
        grads: dict[str, torch.Tensor] = {}
        self._owned = set()
        local = torch.zeros(2, dtype=torch.float64, device=engine.device)
        for unit in engine.units:
            stashed = engine.grad_stash.grad(unit) if engine.grad_stash is not None else None
            if stashed is not None and unit.grad_shard is None:
                grads[unit.key], sq = _stashed_grad(stashed, 1.0 / (unit.grad_divisor * self.scaler.scale))
                if not torch.isfinite(sq):
                    local[1] = 1.0
                else:
                    local[0] += sq / engine.norm_copies(unit)
                continue
            if unit.grad_shard is None:
                continue
            # One pass: the cast copies only a non-fp32 shard, the scaling is then in place;
            # an fp32 shard is scaled out of place (it must keep the unscaled sum for a backward
            # without zero_grad) unless step_then_zero_grad lets the step spend it, and one whose
            # factor is exactly 1 (one rank, no loss scale) is used as it is (x * 1.0 == x).
            grad = unit.grad_shard.to(torch.float32)
            factor = 1.0 / (unit.grad_divisor * self.scaler.scale)
            if grad is not unit.grad_shard:
                grad.mul_(factor)
                self._owned.add(unit.key)
            elif self._spend_grads:
                if factor != 1.0:
                    grad.mul_(factor)  # bitwise grad * factor, without a second shard
                self._owned.add(unit.key)
            elif factor != 1.0:
                grad = grad * factor
                self._owned.add(unit.key)
            grads[unit.key] = grad
            sq = shard_sumsq(grad)
            if not torch.isfinite(sq):
                local[1] = 1.0
            elif unit.tensor_parallel:  # TP shards are distinct across tp ranks: weighted per parameter
                local[0] += weighted_sumsq(unit, grad, engine.norm_copies(unit))
            else:
                local[0] += sq / engine.norm_copies(unit)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with profiling.comm_range("grad_norm_all_reduce"):
                collectives.all_reduce(local, name="ZeRO gradient-norm all-reduce")
        local = local.cpu()
        return grads, float(local[0]), bool(local[1] > 0)

    def _skip(self) -> None:
        """Every rank skips together: masters, moments and parameters untouched."""
        self.scaler.update(True)
        for unit in self.engine.units:
            self.engine.forget_grads(unit)
        notify(self.engine, "on_skipped_step", self.steps_taken)
        self.last_grad_norm = float("nan")
        self.last_breakdown = profiling.close_step()

    def step_then_zero_grad(self) -> None:
        """:meth:`step` followed by :meth:`zero_grad`, for loops that always drop the gradients
        after a step (DeepSpeed's ``engine.step()``). Since nothing reads the reduced gradient
        shards afterwards, the step averages and clips them in place rather than in copies: one
        or two fewer passes over, and allocations of, every shard. The values are bit for bit
        those of ``step(); zero_grad()``.

        Raises:
            ReplicaMismatchError: as :meth:`step`.
        """
        self._spend_grads = self._cached is None  # gradients cached by clip_grad_norm_ are copies already
        try:
            self.step()
        finally:
            self._spend_grads = False
        self.zero_grad()

    # ---- gradients ----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient this rank holds (reduced shards, local full gradients)."""
        self.engine.wait_reductions()
        self._cached = None
        for unit in self.engine.units:
            self.engine.forget_grads(unit)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global gradient norm across every shard; clipping to ``max_norm`` is applied inside the
        next ``step()`` (after reduction, before the update), as one fused operation.

        Returns:
            The total norm of the averaged, unscaled gradients before clipping.

        Raises:
            ValueError: ``max_norm`` is not a positive finite number.
        """
        if not (isinstance(max_norm, int | float) and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): pass a positive finite number, e.g. 1.0.")
        notify(self.engine, "clip_requested", float(max_norm))  # extensions that clip what they reduce
        with torch.no_grad():
            self._cached = self._averaged_grads()
        _grads, sumsq, overflow = self._cached
        self._clip_request = float(max_norm)
        return float("inf") if overflow else math.sqrt(sumsq)

    # ---- state --------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank saw a non-finite gradient."""
        return self.scaler.skipped_steps

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its shards), the loss scaler and the step count.

        Semantics: the inner optimizer's ``state_dict`` over this rank's master shards, valid for
        a load at the same world size, stage and parameter grouping. To change layouts use
        :meth:`plait.zero_sharding.ZeroModule.sharded_state_dict` (plait-universal-ckpt).
        """
        return {"inner": self.inner.state_dict(), "loss_scaler": self.scaler.state_dict(),
                "steps_taken": self.steps_taken,
                "masters": {key: m.detach().clone() for key, m in self.engine.placement.masters().items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same layout) and refresh the parameters from the masters."""
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.scaler.load_state_dict(state_dict["loss_scaler"])
        self.steps_taken = int(state_dict["steps_taken"])
        with torch.no_grad():
            for key, value in state_dict["masters"].items():
                self.engine.placement.masters()[key].copy_(value)
            for unit in self.engine.units:
                unit.refresh_from_master(self.engine.placement, self.engine.gatherer)
            self.engine.settle_shards()


def _wait_gather(handle: Any) -> None:
    """Wait for a post-step all-gather (timed as communication wait)."""
    if handle is not None:
        with profiling.comm_range("wait_all_gather"):
            wait(handle)


def _stashed_grad(stashed: StashedGrad, factor: float) -> tuple[StashedGrad, torch.Tensor]:
    """A stored gradient scaled by ``factor`` (applied when the step reads it) and its squared
    norm, computed over the whole shard read back once, as the in-memory path does."""
    scaled = stashed * factor
    return scaled, shard_sumsq(scaled.read())


class _ShardWrites:
    """Offloaded compute shards refreshed by a step, whose writes are in flight: at most
    ``limit`` stay in memory; older ones are freed as soon as their write is done (a failed one
    stays in memory and is raised by ``settle_shards`` at the end of the step). Without the
    bound every unit's refreshed shard (the whole model at one rank) was held until then."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self.pending: list[Any] = []

    def started(self, unit: Any) -> None:
        """``unit``'s shard was just refreshed (and its write started, when it is offloaded)."""
        if unit.storage is None or unit.resident:
            return
        self.pending.append(unit)
        while len(self.pending) > self.limit:
            self.pending.pop(0).drop_shard()
