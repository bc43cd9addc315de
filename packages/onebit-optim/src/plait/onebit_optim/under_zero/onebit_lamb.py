"""1-bit LAMB under ZeRO stages 1 and 2: the inner optimizer over the fp32 master shards.

The exchange is 1-bit Adam's (:class:`plait.onebit_optim.under_zero.exchange.OnebitZeroExchange`: the momentum
is what crosses the network in both algorithms). What LAMB adds are per-tensor quantities that a
flat ZeRO shard cuts across: the norms of the parameter and of the update (the trust ratio),
during warm-up, and after it the norms of the preliminary update and the update and the largest
ratio of the frozen to the fresh variance denominator (the coefficient's factor). Each rank
computes them over the pieces of each tensor it owns and all-reduces per unit and step complete
them: the ratio by a MAX all-reduce (exact in any order), the norms by an exact sum
(:mod:`plait.onebit_optim.rules.lamb`: a MAX all-reduce of the pieces' largest magnitudes, then a
SUM all-reduce of their squares in int64 fixed point).

Numerics against :class:`plait.onebit_optim.OnebitLamb`: it takes the same exact norm of each
whole tensor, and integers add the same however the tensor is cut, so the norms, and with them
every update, are the plain optimizer's bit for bit at any world size.

The per-tensor trust-ratio average (``lamb_coeff_freeze``) and the last factor are the same on
every rank (computed from all-reduced norms). They are committed when the engine says a step was
taken (``on_step``), so the zero-gradient step ``ensure_optimizer_state`` runs before a save or
load leaves them alone, and saved as ``ext.onebit.lamb.*`` pieces by the exchange.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.sharded_state import ShardedTensor, ShardSpec
from plait.onebit_optim.data_parallel.base import run_closure
from plait.onebit_optim.rules.lamb import (
    frozen_lamb_direction,
    lamb_direction_,
    norm_exponent,
    norm_from_limbs,
    square_limbs,
)
from plait.onebit_optim.under_zero.layout import ShardedInner
from plait.onebit_optim.under_zero.replicated_lamb import owner_pieces
from plait.onebit_optim.under_zero.variance_floor import floor_shard_


def _lamb_state(state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
        # Created with the rest (not at the first compressed step, as OnebitLamb does) so that the
        # state a checkpoint load fills in place has it; warm-up keeps it equal to exp_avg_sq.
        state["exp_avg_sq_fresh"] = torch.zeros_like(p)
    return state


class ShardedOnebitLamb(ShardedInner):
    """The inner optimizer of 1-bit LAMB under ZeRO (see the module docstring). ``zero_shard``
    builds it through :func:`plait.onebit_optim.under_zero.compose.compose_with_zero`."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)
        # Per unit key, one entry per tensor (slot) of the unit, float64, equal on every rank.
        self.coeff_freeze: dict[str, torch.Tensor] = {}
        self.last_factor: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple[str, torch.Tensor]] = {}

    # ---- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every master shard: LAMB during warm-up, the frozen-variance 1-bit LAMB
        update from the exchanged momentum after it."""
        loss = run_closure(closure)
        self.exchange.run_deferred()  # clipping / fp16: the units are exchanged now
        keys = {id(m): k for k, m in self.exchange.engine.placement.masters().items()}
        self._pending = {}
        for group in self.param_groups:
            for p in group["params"]:
                key = keys[id(p)]
                momentum = self.exchange.take_momentum(key) if self.exchange.compressing else None
                if momentum is not None:
                    self._compressed_update(p, key, momentum, group)
                elif p.grad is not None and not self.exchange.compressing:
                    self._warmup_update(p, key, group)
        return loss

    def on_step(self) -> None:
        """The engine took the step: commit the per-tensor coefficient state it computed."""
        beta = self.config.coeff_beta
        for key, (kind, values) in self._pending.items():
            if kind == "warmup":
                self.coeff_freeze[key] = beta * self.coeff_freeze[key] + (1 - beta) * values
                self.last_factor[key] = torch.ones_like(values)
            else:
                self.last_factor[key] = values
        self._pending = {}

    def _ensure_coeff(self, key: str, tensors: int) -> None:
        if key not in self.coeff_freeze:
            self.coeff_freeze[key] = torch.zeros(tensors, dtype=torch.float64)
            self.last_factor[key] = torch.ones(tensors, dtype=torch.float64)

    def _warmup_update(self, p: torch.Tensor, key: str, group: dict[str, Any]) -> None:
        unit = self.exchange.units[key].unit
        self._ensure_coeff(key, len(unit.slots))
        state = _lamb_state(self.state[p], p)
        update = lamb_direction_(p, state, group)
        weight_norm, update_norm = _tensor_norms(unit, [(owner_pieces(unit, unit.group_rank), (p, update))], True)
        coeffs = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
        coeffs.clamp_(self.config.min_coeff, self.config.max_coeff)
        self._apply(p, unit, update, -group["lr"] * coeffs)
        state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])  # the fresh variance starts from the frozen one
        self._pending[key] = ("warmup", coeffs)

    def _compressed_update(self, p: torch.Tensor, key: str, momentum: torch.Tensor, group: dict[str, Any]) -> None:
        cfg, unit = self.config, self.exchange.units[key].unit
        self._ensure_coeff(key, len(unit.slots))
        state = _lamb_state(self.state[p], p)
        if int(self.exchange.steps[0]) == self.exchange.freeze_step:  # the variance freezes now: floor it, and
            floor_shard_(unit, state["exp_avg_sq"], cfg.variance_floor, name="OnebitLamb")  # start the
            state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])  # fresh one from it, as OnebitLamb does
        # zero_param_sync="update" (under_zero.replicated_lamb): every other owner's chunk of the replica
        # too, with the per-tensor maxima and norms taken over all chunks here instead of all-reduced.
        replica = getattr(self.exchange, "other_chunks", None)
        if replica is not None:
            self.exchange.prepare(key, state)  # before this step changes the fresh variance shard
        # exp_avg (the last synchronised momentum shard) is consumed and becomes ``momentum``.
        chunks = [_chunk(p, owner_pieces(unit, unit.group_rank), state, momentum, state["exp_avg"], group)]
        if replica is not None:
            chunks += [_chunk(chunk_p, owner_pieces(unit, owner), chunk_state, chunk_m, last, group)
                       for owner, chunk_p, chunk_state, chunk_m, last in replica(key)]
        reduce = replica is None
        factors = _tensor_max(unit, [(c.pieces, c.ratio) for c in chunks], reduce)
        if group["weight_decay"]:
            prelim_norm, update_norm = _tensor_norms(unit, [(c.pieces, (c.prelim, c.update)) for c in chunks], reduce)
            ratio = torch.where(update_norm > 0, (prelim_norm / update_norm).clamp(max=1.0), 1.0)
            factors = factors * ratio + (1 - ratio)
        factors.clamp_(cfg.factor_min, cfg.factor_max)
        last_factor = self.last_factor[key]
        factors = torch.minimum(torch.maximum(factors, last_factor * (1 - cfg.factor_threshold)),
                                last_factor * (1 + cfg.factor_threshold))
        alphas = -group["lr"] * self.coeff_freeze[key] * factors
        for c in chunks:
            for index, slo, shi in c.pieces:
                c.params[slo:shi].add_(c.update[slo:shi], alpha=float(alphas[index]))
        self._pending[key] = ("compressed", factors)

    @staticmethod
    def _apply(p: torch.Tensor, unit: Any, update: torch.Tensor, alphas: torch.Tensor) -> None:
        """``p += alpha_t * update`` over each tensor ``t``'s piece of the shard."""
        for slot, _, (slo, shi) in unit.local_pieces():
            p[slo:shi].add_(update[slo:shi], alpha=float(alphas[unit.slots.index(slot)]))

    # ---- checkpoints ------------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """``ext.onebit.lamb.coeff.<parameter>`` and ``ext.onebit.lamb.factor.<parameter>``: one
        float64 value per tensor, the same on every rank (replicated pieces)."""
        everyone = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
        out = {}
        for key, state in self.exchange.units.items():
            self._ensure_coeff(key, len(state.unit.slots))
            for index, slot in enumerate(state.unit.slots):
                for kind, values in (("coeff", self.coeff_freeze[key]), ("factor", self.last_factor[key])):
                    name = f"ext.onebit.lamb.{kind}.{slot.global_name}"
                    piece = values[index:index + 1]
                    out[name] = ShardedTensor(ShardSpec.full(name, piece, kind="other", replica_ranks=everyone), piece)
        return out


class _Chunk(NamedTuple):
    """One owner's chunk of a unit in a compressed step: the parameters it updates, its tensor
    pieces, and its elementwise quantities (each the shard's length)."""

    params: torch.Tensor
    pieces: list[tuple[int, int, int]]
    ratio: torch.Tensor  # frozen / fresh variance denominator
    prelim: torch.Tensor
    update: torch.Tensor


def _chunk(p: torch.Tensor, pieces: list[tuple[int, int, int]], state: dict[str, Any], momentum: torch.Tensor,
           last: torch.Tensor, group: dict[str, Any]) -> _Chunk:
    """The elementwise part of 1-bit LAMB's compressed step on one chunk (``last`` is consumed)."""
    denom, prelim, update = frozen_lamb_direction(p, state, momentum, last, group)
    return _Chunk(p, pieces, denom / state["exp_avg_sq_fresh"].sqrt().add_(group["eps"]), prelim, update)


Pieces = list[tuple[int, int, int]]


def _raise(maxima: torch.Tensor, index: int, value: float) -> None:
    """``maxima[index] = max(maxima[index], value)``, where a NaN wins (as a tensor's max, and a MAX
    all-reduce, keep it) and stays."""
    if math.isnan(value) or value > float(maxima[index]):
        maxima[index] = value


def _tensor_norms(unit: Any, chunks: list[tuple[Pieces, tuple[torch.Tensor, ...]]],
                  reduce: bool) -> tuple[torch.Tensor, ...]:
    """Whole-tensor L2 norms (float64, one per slot of ``unit``) of each row of shard-shaped
    tensors, over the pieces of the given chunks (this rank's shard; with ``zero_param_sync="update"``
    every owner's chunk), summed exactly (:mod:`plait.onebit_optim.rules.lamb`): the pieces' largest
    magnitudes fix each tensor's fixed-point exponent, their int64 limbs add up. With ``reduce`` a
    MAX and a SUM all-reduce over the unit's group complete them (``8 + 16`` bytes per tensor and
    row). Bit for bit ``exact_norm`` of the whole tensor, at any world size and either way."""
    rows = len(chunks[0][1])
    maxima = torch.zeros(rows, len(unit.slots), dtype=torch.float64)
    for pieces, flats in chunks:
        for index, slo, shi in pieces:
            for row, flat in enumerate(flats):
                _raise(maxima[row], index, float(flat[slo:shi].abs().max()))
    maxima.nan_to_num_(nan=float("inf"))  # a NaN piece makes its tensor's norm inf (a MAX keeps inf)
    if reduce and unit.group_size > 1:
        collectives.all_reduce(maxima, op=dist.ReduceOp.MAX, group=unit.group,
                               name=f"OnebitLamb per-tensor norm maximum all-reduce of `{unit.key}`")
    finite = maxima.isfinite()
    exponents = [[norm_exponent(v) if ok else 0 for v, ok in zip(row, oks)]
                 for row, oks in zip(maxima.tolist(), finite.tolist())]
    limbs = torch.zeros(rows, len(unit.slots), 2, dtype=torch.int64)
    for pieces, flats in chunks:
        for index, slo, shi in pieces:
            for row, flat in enumerate(flats):
                if bool(finite[row, index]):
                    limbs[row, index] += square_limbs(flat[slo:shi], exponents[row][index])
    if reduce and unit.group_size > 1:
        collectives.all_reduce(limbs, group=unit.group, name=f"OnebitLamb per-tensor norm all-reduce of `{unit.key}`")
    norms = torch.tensor([[norm_from_limbs(limbs[row, t], exponents[row][t]) for t in range(len(unit.slots))]
                          for row in range(rows)], dtype=torch.float64)
    return tuple(torch.where(finite, norms, maxima))


def _tensor_max(unit: Any, chunks: list[tuple[Pieces, torch.Tensor]], reduce: bool) -> torch.Tensor:
    """Whole-tensor maxima (float64, one per slot) of shard-shaped tensors over the given chunks'
    pieces, with ``reduce`` completed by a MAX all-reduce (exact in any order)."""
    maxima = torch.full((len(unit.slots),), float("-inf"), dtype=torch.float64)
    for pieces, flat in chunks:
        for index, slo, shi in pieces:
            _raise(maxima, index, float(flat[slo:shi].max()))
    if reduce and unit.group_size > 1:
        collectives.all_reduce(maxima, op=dist.ReduceOp.MAX, group=unit.group,
                               name=f"OnebitLamb per-tensor factor all-reduce of `{unit.key}`")
    return maxima
