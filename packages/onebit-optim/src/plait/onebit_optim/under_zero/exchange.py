"""1-bit Adam (and 1-bit LAMB) under ZeRO stages 1 and 2: the owner of a shard is the server of
the 1-bit exchange.

``zero_shard(model, OnebitAdam, ZeroConfig(stage=2), lr=..., onebit_config=OnebitAdamConfig(...))`` (or
an ``OnebitAdam`` instance) calls :func:`plait.onebit_optim.under_zero.compose.compose_with_zero`
(plait-zero-sharding looks the hook up by name; nothing here imports it). It returns an
engine-wide reducer, :class:`OnebitZeroExchange` (this module), and the inner optimizer class,
``ShardedOnebitAdam``, built over the fp32 master shards. Per step, per ZeRO unit (a flat
bucket, padded so rank ``r`` owns ``[r * shard, (r + 1) * shard)``):

* warm-up (``step <= freeze_step``): the reducer is ZeRO's plain reduce-scatter and the inner
  optimizer is torch's AdamW kernel on the averaged shards, so parameters equal ZeRO +
  ``torch.optim.AdamW`` bit for bit; with ``freeze_step="auto"`` the step is chosen when the
  variance has settled, from per-tensor sums completed by one small all-reduce after each
  warm-up step (:mod:`plait.onebit_optim.under_zero.settle`);
* after it the reducer receives this rank's local gradient bucket and runs the worker side of
  the compressed all-reduce on its local momentum ``beta1 m + (1 - beta1) g`` (``m`` the full
  synchronised momentum of the unit, decoded from the 1-bit form every rank kept from the last
  step): per-tensor RMS scaling, worker error feedback, all-to-all of packed signs; the owner of
  each shard averages its chunk, adds its server error and recompresses (server error feedback);
  the server signs are all-gathered (``n / 8`` bytes) so every rank keeps the synchronised
  momentum of the whole unit in 1 bit for the next step. The owner's decoded chunk is the
  averaged momentum of its shard; the inner optimizer steps the shard's master with it and the
  frozen variance (raised, at the first compressed step, to its floor: each tensor's mean summed
  across the shards, :mod:`plait.onebit_optim.under_zero.variance_floor`); ZeRO's exact post-step
  parameter all-gather follows unchanged.

This is plain-data-parallel 1-bit Adam with one exchange per ZeRO unit (instead of one per
param group) and the server chunks equal to the ZeRO shards: with the same grouping the results
are bitwise equal (``tests/test_onebit_zero.py``).

Checkpoints: the reducer's ``sharded_state_dict`` adds ``ext.onebit.*`` pieces (the step
counter, with ``"auto"`` the freeze decision and its observations, each unit's worker error as
rows of a ``[world, n]`` tensor, its server error, the momentum masks); the momentum itself is
the optimizer's sharded ``exp_avg``. Resharding the worker error to another world size:
:func:`expect_checkpoint_world`.

1-bit LAMB exchanges its momentum the same way (``zero_shard(model, OnebitLamb, ...)``); its inner
optimizer is :class:`plait.onebit_optim.under_zero.onebit_lamb.ShardedOnebitLamb`, whose per-tensor
coefficients this exchange commits on ``on_step`` and saves with its own pieces.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.ops.sign import compress_with_error_feedback, unpack_scaled_signs
from plait.kernels.sharded_state import ShardedTensor, ShardSpec, piece_key
from plait.onebit_optim.config import OnebitAdamConfig, OnebitLambConfig
from plait.onebit_optim.rules.settle import FreezePoint
from plait.onebit_optim.under_zero.layout import ShardedInner, UnitState, chunk_of, from_logical, to_logical
from plait.onebit_optim.under_zero.settle import freeze_pieces, load_freeze_pieces, shard_variance_sums


def expect_checkpoint_world(optimizer_or_model: Any, world: int) -> None:
    """Before loading a checkpoint saved at another world size: read its worker errors as rows of
    a ``[world, n]`` tensor and reshard them (new rank ``r`` takes the mean of the saved rows
    ``r, r + W', r + 2W', ...`` when shrinking, row ``r mod W`` when growing: either way the mean
    over ranks, which is what the servers average, is kept); server errors reshard with the
    parameters, exactly. Without this call a load at another world size is refused by the
    checkpoint's shape check.

    Args:
        optimizer_or_model: the ``ZeroOptimizer`` or the sharded model.
        world: the world size the checkpoint was saved at.
    """
    engine = getattr(optimizer_or_model, "zero_engine", None) or getattr(optimizer_or_model, "engine", None)
    exchange = engine.reducer if engine is not None else None
    if not isinstance(exchange, OnebitZeroExchange):
        raise ValueError("expect_checkpoint_world needs a model or ZeroOptimizer sharded with OnebitAdam.")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"expect_checkpoint_world(world={world!r}): pass the saved world size, an integer >= 1.")
    exchange.checkpoint_world = world




class OnebitZeroExchange:
    """The engine-wide ``GradientReducer`` of 1-bit Adam and 1-bit LAMB under ZeRO (see the module
    docstring).

    Args:
        config: the ``OnebitAdamConfig`` or ``OnebitLambConfig`` (its ``freeze_step``, an integer
            or ``"auto"``, and ``settle`` are read here: :mod:`plait.onebit_optim.under_zero.settle`).
        masks: ``{id(parameter): fp32 0/1 mask}`` applied to the exchanged momentum.
    """

    NAME = "OnebitAdam"  # in the flight log's collective names

    def __init__(self, config: OnebitAdamConfig | OnebitLambConfig, masks: dict[int, torch.Tensor]) -> None:
        self.config, self.masks = config, masks
        self.optimizer: ShardedInner | None = None
        self.engine: Any = None
        self.units: dict[str, UnitState] = {}
        self.steps = torch.zeros(1, dtype=torch.int64)  # updates taken (a tensor: a checkpoint piece)
        # When the variance freezes (fixed or "auto"); 0/1 Adam's config has no freeze_step.
        self.freeze_point = FreezePoint(
            f"{'OnebitLamb' if isinstance(config, OnebitLambConfig) else 'OnebitAdam'} under ZeRO",
            config.freeze_step, config.settle) if hasattr(config, "freeze_step") else None
        self.reduced: set[str] = set()
        self.checkpoint_world: int | None = None
        self._staged: dict[str, Any] = {}
        # Deferred mode (gradient clipping, fp16): each unit's local gradient bucket, kept from its
        # reduction to the step, where the units are exchanged (see run_deferred).
        self.deferred = False
        self.max_grad_norm: float | None = None
        self.last_grad_norm: float | None = None
        self._kept: dict[str, tuple[torch.Tensor, Any]] = {}
        self._clip_request: float | None = None  # from ZeroOptimizer.clip_grad_norm_, for this step

    # ---- engine hooks -------------------------------------------------------------------------
    def bind(self, engine: Any) -> None:
        """Lay out every unit's exchange and error buffers (called once by ``zero_shard``)."""
        hsdp = [unit.key for unit in engine.units if unit.replicate_group is not None]
        if hsdp:
            raise ValueError("OnebitAdam under ZeRO shards over one group; the mesh leaves dimensions outside "
                             "ZeroConfig.shard_dims (HSDP replicas), whose gradients the 1-bit exchange would not "
                             "average. Shard over every data-parallel dimension (shard_dims) or pass mesh['dp'].")
        self.engine = engine
        self.units = {unit.key: UnitState(unit) for unit in engine.units}
        config = engine.config
        # Clipping needs every unit's local gradient before the first one is exchanged, and an
        # fp16 step may be skipped after backward: both exchange at the step, not during backward,
        # so a skipped step leaves the error feedback untouched.
        self.max_grad_norm = config.max_grad_norm
        self.deferred = config.max_grad_norm is not None or torch.float16 in (config.compute_dtype,
                                                                               config.reduce_dtype)
        params = {id(slot.param) for unit in engine.units for slot in unit.slots}
        stray = [pid for pid in self.masks if pid not in params]
        if stray:
            raise ValueError("momentum_masks: a mask is given for a tensor that is not a parameter of the sharded "
                             "model; key the dict by the model's parameters.")

    @property
    def compressing(self) -> bool:
        """Whether the next step is past warm-up (the momentum is exchanged in 1 bit)."""
        return self.freeze_point.frozen_after(int(self.steps[0]) + 1)

    @property
    def freeze_step(self) -> int | None:
        """The last warm-up step: the config's integer ``freeze_step``, or with ``"auto"`` the step
        it chose (``None`` until the variance has settled; the same on every rank)."""
        return self.freeze_point.step

    def on_step(self, step: int) -> None:
        """An update was taken: count it (the freeze state), observe the variance after a warm-up
        step (``"auto"`` and the early-freeze warning: one all-reduce of per-tensor sums when the
        freeze point watches), and forget this step's reductions."""
        taken = int(self.steps[0]) + 1
        warmup = self.freeze_point is not None and not self.freeze_point.frozen_after(taken)
        self.steps += 1
        if warmup:
            units = [state.unit for state in self.units.values()]
            self.freeze_point.after_warmup_step(taken, lambda: shard_variance_sums(
                units, self.optimizer, self.engine.placement.masters(), name=self.freeze_point.owner))
        self.reduced.clear()
        for state in self.units.values():
            state.momentum = None
        commit = getattr(self.optimizer, "on_step", None)  # 1-bit LAMB's per-tensor coefficients
        if commit is not None:
            commit()

    def clip_requested(self, max_norm: float) -> None:
        """``ZeroOptimizer.clip_grad_norm_(max_norm)`` (Lightning's ``gradient_clip_val``). In warm-up
        the engine clips ZeRO's reduced gradients itself. After it the engine's gradient shards are
        zeros (the momentum is exchanged instead), so the deferred exchange clips the local
        gradients by ``max_norm`` at the step, as it does for ``max_grad_norm``.

        Raises:
            RuntimeError: after warm-up without deferral (no ``max_grad_norm``, no fp16): the exchange
                already ran during backward and nothing could be clipped.
        """
        if not self.compressing:
            return
        if not self.deferred:
            raise RuntimeError(
                "clip_grad_norm_ after the 1-bit warm-up (freeze_step) cannot clip: the momentum was already "
                "exchanged during backward. Set ZeroConfig(max_grad_norm=...) (the exchange then waits for the "
                "step and clips there; clip_grad_norm_ may then lower the bound per step), or stop clipping by hand.")
        self._clip_request = max_norm

    def on_skipped_step(self, step: int) -> None:
        """A skipped step (a non-finite gradient on some rank): nothing was updated, the freeze
        counter stays, and the gradients kept for the step (deferred mode) are dropped unused."""
        self.reduced.clear()
        self._kept.clear()
        self._clip_request = None
        for state in self.units.values():
            state.momentum = None

    def all_reduce(self, tensor: torch.Tensor, *, group: Any, key: str) -> Any:
        """Plain sum (the engine calls it only for HSDP replicas, which 1-bit Adam does not use)."""
        return collectives.all_reduce(tensor, group=group, async_op=True)

    def reduce_scatter(self, full: torch.Tensor, shard_out: torch.Tensor, *, group: Any, key: str) -> Any:
        """Warm-up: ZeRO's reduce-scatter. After it: the 1-bit momentum exchange of the unit;
        ``shard_out`` gets zeros (the inner step reads the averaged momentum shard from here)."""
        if not self.compressing:
            return collectives.reduce_scatter_tensor(shard_out, full, group=group, async_op=True)
        self._claim(key)
        if self.deferred:
            self._keep(full, shard_out, group, key)
            return None
        shard_out.zero_()
        state = self.units[key]
        if state.signs is None and state.scales is None:  # no 1-bit form yet (first compressed step, a load)
            self._gather_momentum(state)
        with torch.no_grad():
            state.momentum = self._exchange(state, full.to(torch.float32), group)
        if state.momentum is None:  # non-finite momentum somewhere: not exchanged, the engine skips the step
            shard_out.fill_(float("nan"))
        return None

    def _claim(self, key: str) -> None:
        """Note that unit ``key`` is reduced this step; a second reduction before the step is refused."""
        if key in self.reduced:
            raise RuntimeError(
                f"{self.NAME} under ZeRO: unit {key!r} was reduced twice before one step; after warm-up the "
                "exchange runs once per step, so accumulate gradients inside model.no_sync() (stage 2) and let the "
                "last backward of the step reduce.")
        self.reduced.add(key)

    def _keep(self, full: torch.Tensor, shard_out: torch.Tensor, group: Any, key: str) -> None:
        """Keep this rank's local gradient bucket for the step; ``shard_out`` gets zeros, or NaN when
        the bucket is not finite (a local check: the engine all-reduces its overflow flag, so every
        rank skips together)."""
        shard_out.zero_()
        if not bool(torch.isfinite(full).all()):
            shard_out.fill_(float("nan"))
        self._kept[key] = (full, group)

    def run_deferred(self) -> None:
        """Deferred mode, at the step (called by the inner optimizer): unscale the kept local
        gradients (fp16), clip them by ``max_grad_norm`` against the root mean square over ranks of
        the local gradient norms, and exchange every kept unit, in unit order."""
        if not self._kept:
            return
        kept, self._kept = self._kept, {}
        limit, self._clip_request = self._clip_request or self.max_grad_norm, None
        scale = float(getattr(getattr(self.engine.model, "zero_optimizer", None), "loss_scale", 1.0))
        coefficient = 1.0 / scale
        if limit is not None:
            self.last_grad_norm = self._local_norm(kept, scale)
            if self.last_grad_norm > limit:  # the engine's clipping formula
                coefficient *= limit / (self.last_grad_norm + 1e-6)
        with torch.no_grad():
            for key, state in self.units.items():
                if key not in kept:
                    continue
                full, group = kept.pop(key)
                if state.signs is None and state.scales is None:
                    self._gather_momentum(state)
                grads = full.to(torch.float32)
                grads = grads * coefficient if coefficient != 1.0 else grads  # never in place: stage 1's buffer
                del full
                state.momentum = self._exchange(state, grads, group)

    def _local_norm(self, kept: dict[str, tuple[torch.Tensor, Any]], scale: float) -> float:
        """``sqrt(mean over ranks of ||g_rank||^2)``, unscaled: it bounds the averaged gradient's
        norm from above (equal to it when the ranks' gradients are equal); one float64 all-reduce."""
        squares = torch.zeros(1, dtype=torch.float64)
        for full, _ in kept.values():
            squares += float(torch.linalg.vector_norm(full, dtype=torch.float32)) ** 2
        group = next(iter(kept.values()))[1]
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world > 1:
            collectives.all_reduce(squares, group=group, name="OnebitAdam local gradient-norm all-reduce (clipping)")
        return math.sqrt(float(squares) / world) / scale

    # ---- the exchange -------------------------------------------------------------------------
    def _gather_momentum(self, state: UnitState) -> None:
        """Exact all-gather of a unit's ``exp_avg`` shards (once: at its first compressed step and
        after a checkpoint load); the full fp32 momentum is used right away by the exchange."""
        unit = state.unit
        master = self.engine.placement.masters()[unit.key]
        inner_state = self.optimizer.state.get(master) or {}
        shard = inner_state.get("exp_avg")
        if shard is None:
            shard = torch.zeros(unit.shard_numel, dtype=torch.float32, device=unit.device)
        full = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.device)
        collectives.all_gather_into_tensor(full, shard.detach().contiguous(), group=unit.group,
                                           name=f"{self.NAME} momentum all-gather of `{unit.key}` (once)")
        state.signs, state.scales, state.factors = None, full, []

    def _full_momentum(self, state: UnitState) -> torch.Tensor:
        """The unit's synchronised momentum (padded flat fp32), decoded from the 1-bit form."""
        unit = state.unit
        if state.signs is None:  # gathered in fp32 (first compressed step / after a load)
            assert state.scales is not None
            return state.scales.clone()  # the caller updates it in place; a skipped step needs it again
        decoded = state.scratch_buffer("decoded", state.world * state.chunk).view(state.world, state.chunk)
        for server, signs in enumerate(state.signs.view(state.world, -1)):  # +-(that server's scale)
            unpack_scaled_signs(signs, state.chunk, state.scales[server], out=decoded[server])
        flat = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.device)  # padded = world x shard:
        flat.view(state.world, state.shard).copy_(decoded[:, :state.shard])  # every element is written here
        for slot, factor in zip(unit.slots, state.factors):
            part = flat[slot.offset:slot.offset + slot.numel]
            part.div_(factor)  # in place: the same division, without a temporary of the tensor
            mask = self.masks.get(id(slot.param))
            if mask is not None:
                part.mul_(mask.reshape(-1))
        flat[unit.numel:].zero_()
        return flat

    def _exchange(self, state: UnitState, grads: torch.Tensor, group: Any) -> torch.Tensor | None:
        """The unit's 1-bit exchange of ``beta1 m + (1 - beta1) grads`` (fp32, unscaled); returns the
        owner's averaged momentum shard, or ``None`` (state untouched) when it is not finite somewhere."""
        unit, world = state.unit, state.world
        group_options = self.optimizer.param_groups[unit.option_index]
        beta1 = group_options["betas"][0]
        momentum = self._full_momentum(state)
        local = momentum.view(-1)[:unit.padded_numel]
        local.mul_(beta1).add_(grads, alpha=1 - beta1)
        local[unit.numel:].zero_()
        if world == 1:  # the average of one value is the value: nothing to compress
            if not bool(torch.isfinite(local).all()):
                return None
            for slot in unit.slots:
                mask = self.masks.get(id(slot.param))
                if mask is not None:
                    local[slot.offset:slot.offset + slot.numel].mul_(mask.reshape(-1))
            state.signs, state.scales, state.factors = None, local, []
            return local[:unit.shard_numel].clone()
        scaled = self._scaled_buffer(state, local, group)
        if scaled is None:  # some rank's momentum is not finite: keep it out of the errors
            return None
        buffer, factors = scaled
        del local, momentum
        signs, scales, own = self._compressed_allreduce(state, buffer, group, unit.key)
        state.signs, state.scales, state.factors = signs, scales, factors
        return self._own_shard(state, own, factors)

    def _scaled_buffer(self, state: UnitState, local: torch.Tensor,
                       group: Any) -> tuple[torch.Tensor, list[float]] | None:
        """``local`` (the unit's padded flat fp32 values, not modified) brought to a common scale
        per tensor (its RMS averaged over ranks: one all-reduce of ``4 x tensors`` bytes, as the
        plain exchange does) and laid out as ``world`` server chunks; ``None`` when some rank's RMS
        is not finite. Returns ``(flat buffer, per-tensor factors)``."""
        unit, world = state.unit, state.world
        tensors = [local[s.offset:s.offset + s.numel].view(s.shape) for s in unit.slots]
        rms = torch.stack([torch.linalg.vector_norm(t.float()) / math.sqrt(max(t.numel(), 1)) for t in tensors])
        collectives.all_reduce(rms, group=group, name=f"{self.NAME} per-tensor RMS all-reduce of `{unit.key}`")
        if not bool(torch.isfinite(rms).all()):
            return None
        rms.mul_(1.0 / world)
        united = rms.mean()
        factors = torch.where(rms > 0, united / rms, 1.0).tolist()
        # Kept buffers (the caller is done with them before this unit's next exchange); where a shard
        # is whole sign bytes the exchange layout is the logical one and the values go straight in.
        buffer = state.scratch_buffer("exchange", world * state.chunk)
        direct = state.chunk == state.shard
        logical = buffer if direct else state.scratch_buffer("logical", unit.padded_numel)
        for slot, tensor, factor in zip(unit.slots, tensors, factors):
            torch.mul(tensor.reshape(-1), factor, out=logical[slot.offset:slot.offset + slot.numel])
        if not direct:
            buffer.view(world, state.chunk)[:, :state.shard].copy_(logical.view(world, state.shard))
        return buffer, factors

    def _own_shard(self, state: UnitState, own: torch.Tensor, factors: list[float]) -> torch.Tensor:
        """This rank's decoded server chunk as its shard of the unit: unscaled per tensor, masked,
        padding zero."""
        unit = state.unit
        shard = torch.zeros(unit.shard_numel, dtype=torch.float32, device=unit.device)
        shard.copy_(own[:state.shard])
        for slot, (plo, phi), (slo, shi) in unit.local_pieces():
            factor = factors[unit.slots.index(slot)]
            part = shard[slo:shi]
            part.div_(factor)  # in place: the same division, without a temporary of the tensor
            mask = self.masks.get(id(slot.param))
            if mask is not None:
                part.mul_(mask.reshape(-1)[plo:phi])
        lo, _ = unit.shard_range
        shard[max(0, unit.numel - lo):].zero_()
        return shard

    def _compressed_allreduce(self, state: UnitState, buffer: torch.Tensor, group: Any, key: str, *,
                              gather: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """``plait.kernels.collectives.compressed_allreduce``'s algorithm, keeping the packed server
        signs (the 1-bit values every rank holds) and decoding only this rank's chunk. With
        ``gather=False`` the server signs and scales stay on their owner (only the owner needs its
        chunk: 0/1 Adam's gradient exchange): ``(None, None, own chunk)``."""
        world, chunk = state.world, state.chunk
        packed, worker_scale = compress_with_error_feedback(buffer, state.worker_error)
        received = torch.empty_like(packed)
        label = f"{self.NAME} 1-bit exchange of `{key}`"
        collectives.all_to_all_single(received, packed, group=group, name=f"{label}: worker-sign all-to-all")
        worker_scales = buffer.new_empty(world)
        collectives.all_gather_into_tensor(worker_scales, worker_scale.reshape(1), group=group,
                                           name=f"{label}: worker-scale all-gather")
        received = received.view(world, -1)
        total = torch.zeros(chunk, dtype=torch.float32, device=buffer.device)
        for worker in range(world):  # rank order, as the kernels' server average
            total += unpack_scaled_signs(received[worker], chunk, worker_scales[worker])
        server = total.mul_(1.0 / world)
        server_packed, server_scale = compress_with_error_feedback(server, state.server_error)
        if not gather:
            return None, None, unpack_scaled_signs(server_packed, chunk, server_scale)
        signs = torch.empty(world * server_packed.numel(), dtype=torch.uint8, device=buffer.device)
        collectives.all_gather_into_tensor(signs, server_packed, group=group, name=f"{label}: server-sign all-gather")
        scales = buffer.new_empty(world)
        collectives.all_gather_into_tensor(scales, server_scale.reshape(1), group=group,
                                           name=f"{label}: server-scale all-gather")
        own = unpack_scaled_signs(server_packed, chunk, scales[state.rank])
        return signs, scales, own

    def take_momentum(self, key: str) -> torch.Tensor | None:
        """This step's averaged momentum shard of unit ``key`` (``None``: not exchanged)."""
        state = self.units.get(key)
        return None if state is None else state.momentum

    # ---- checkpoints ----------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """``ext.onebit.*`` pieces: the step counter (freeze state), with ``freeze_step="auto"``
        the freeze point's decision and observations (``ext.onebit.freeze.*``), per unit the worker
        error (row ``rank`` of ``[world, W x chunk]``) and server error (chunk ``rank`` of
        ``[W x chunk]``), the momentum masks (whole, on every rank)."""
        everyone = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
        me = dist.get_rank() if dist.is_initialized() else 0
        out = {"ext.onebit.steps": ShardedTensor(ShardSpec.full("ext.onebit.steps", self.steps, kind="other",
                                                                replica_ranks=everyone), self.steps)}
        if self.freeze_point is not None and self.freeze_point.auto:  # (a fixed step has nothing to decide)
            out.update(freeze_pieces(self.freeze_point, sum(len(s.unit.slots) for s in self.units.values()), everyone))
        saved_world = self.checkpoint_world
        self._staged = {}
        for key, state in self.units.items():
            w_name, s_name = f"ext.onebit.{key}.worker_error", f"ext.onebit.{key}.server_error"
            if saved_world is None or saved_world == state.world:
                n = state.world * state.chunk
                out[w_name] = ShardedTensor(ShardSpec(
                    name=w_name, kind="optimizer_state", global_shape=(state.world, n), dtype=torch.float32,
                    slices=((state.rank, state.rank + 1), (0, n)), replica_ranks=(me,)), state.worker_error.view(1, n))
                out[s_name] = ShardedTensor(ShardSpec(
                    name=s_name, kind="optimizer_state", global_shape=(n,), dtype=torch.float32,
                    flat_range=(state.rank * state.chunk, (state.rank + 1) * state.chunk), replica_ranks=(me,)),
                    state.server_error)
                continue
            # Resharding: stage the saved rows this rank averages, and the whole saved server error.
            old_shard = -(-state.unit.numel // saved_world)
            n_old = saved_world * chunk_of(old_shard)
            rows = [r for r in range(saved_world) if r % state.world == state.rank] or [state.rank % saved_world]
            staged_rows = torch.zeros(len(rows), n_old, device=state.unit.device)
            for i, row in enumerate(rows):
                out[piece_key(w_name, i)] = ShardedTensor(ShardSpec(
                    name=w_name, kind="optimizer_state", global_shape=(saved_world, n_old), dtype=torch.float32,
                    slices=((row, row + 1), (0, n_old)), replica_ranks=(me,)), staged_rows[i].view(1, n_old))
            staged_server = torch.zeros(n_old, device=state.unit.device)
            out[s_name] = ShardedTensor(ShardSpec.full(s_name, staged_server, kind="optimizer_state",
                                                       replica_ranks=(me,)), staged_server)
            self._staged[key] = (old_shard, staged_rows, staged_server)
        for unit_state in self.units.values():
            for slot in unit_state.unit.slots:
                mask = self.masks.get(id(slot.param))
                if mask is not None:
                    name = f"ext.onebit.mask.{slot.global_name}"
                    out[name] = ShardedTensor(ShardSpec.full(name, mask, kind="other", replica_ranks=everyone),
                                              mask.reshape(-1))
        inner_pieces = getattr(self.optimizer, "sharded_state_dict", None)  # 1-bit LAMB's coefficients
        if inner_pieces is not None:
            out.update(inner_pieces())
        return out

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """After a load filled the pieces: reshard staged errors, and re-derive the 1-bit momentum
        from the loaded ``exp_avg`` shards at the next compressed step (one exact all-gather);
        restore ``"auto"``'s freeze point."""
        if self.freeze_point is not None and self.freeze_point.auto:
            load_freeze_pieces(self.freeze_point, state)
        for key, (old_shard, rows, server) in self._staged.items():
            unit_state = self.units[key]
            world_old = self.checkpoint_world
            assert world_old is not None
            logical_worker = to_logical(rows.mean(dim=0), world_old, old_shard, unit_state.unit.numel)
            logical_server = to_logical(server, world_old, old_shard, unit_state.unit.numel)
            unit_state.worker_error.copy_(from_logical(logical_worker, unit_state))
            lo, hi = unit_state.unit.shard_range
            mine = torch.zeros(unit_state.chunk, device=unit_state.unit.device)
            part = logical_server[lo:min(hi, unit_state.unit.numel)]
            mine[:part.numel()] = part
            unit_state.server_error.copy_(mine)
        self._staged = {}
        self.checkpoint_world = None
        self.reduced.clear()
        for unit_state in self.units.values():
            unit_state.signs = unit_state.scales = None
            unit_state.momentum = None
