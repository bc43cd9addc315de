"""plait-onebit-optim under ZeRO: gradient clipping (``ZeroConfig.max_grad_norm``) and skipped
steps (fp16 loss scaling, a non-finite gradient on one rank), on tiny-llama, gloo, two ranks.

After warm-up the engine never sees gradients (the momentum is exchanged instead), so with
clipping or fp16 the 1-bit exchange keeps each unit's local gradient from its reduction to the
step and exchanges there (:meth:`plait.onebit_optim.under_zero.exchange.OnebitZeroExchange.run_deferred`):

* clipping: warm-up clips as ZeRO does (the averaged gradient's exact norm); after it each rank's
  local gradient is clipped against ``sqrt(mean over ranks of ||g_rank||^2)``, which bounds the
  averaged gradient's norm from above. Bitwise plain-data-parallel ``OnebitAdam`` (param groups =
  ZeRO units) with that clipping written by hand, norms summed in the engine's order; and
  deferring with clipping inactive changes nothing, bitwise;
* a skipped step (a non-finite gradient on one rank; fp16 with a static loss scale, stages 1 and
  2, 1-bit Adam and LAMB) leaves the error feedback, the 1-bit momentum and the freeze counter
  untouched: the run equals, bit for bit, the run in which that batch never happened. In fp32
  without clipping the exchange runs during backward; a unit whose momentum is not finite on
  some rank is not exchanged (the per-tensor RMS all-reduce tells every rank), so an infinite
  loss, which reaches every unit, is skipped as cleanly (the fp32 case below).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import global_batch, rank_slice, run_distributed, tiny_llama, train_losses
from plait.onebit_optim import OnebitAdam, OnebitAdamConfig, OnebitLamb, OnebitLambConfig
from plait.onebit_optim.exchange.compressed import average_gradients
from plait.onebit_optim.under_zero.layout import exchange_nbytes
from plait.zero_sharding import ZeroConfig, zero_shard
from plait.zero_sharding.grad_norm import shard_sumsq

BATCH, SEQ, FREEZE = 8, 32, 3
BUCKET = 150_000  # several ZeRO units on tiny-llama
CLIP = 0.5  # below every step's gradient norm here (about 1-3), so every step is clipped


def _model() -> nn.Module:
    torch.manual_seed(0)
    return tiny_llama(num_layers=2, hidden_size=64, num_heads=2)


def _zero(stage: int, lamb: bool = False, **config: object) -> tuple[nn.Module, object]:
    cfg = ZeroConfig(stage=stage, reduce_bucket_elements=BUCKET, **config)
    if lamb:
        return zero_shard(_model(), OnebitLamb, cfg, lr=1e-3, weight_decay=0.01,
                          onebit_config=OnebitLambConfig(freeze_step=FREEZE))
    return zero_shard(_model(), OnebitAdam, cfg, lr=1e-3, weight_decay=0.01,
                      onebit_config=OnebitAdamConfig(freeze_step=FREEZE, variance_floor=0))


def _masters(model: nn.Module) -> list[torch.Tensor]:
    return [m.detach().clone() for m in model.zero_engine.placement.masters().values()]


# ---- clipping -----------------------------------------------------------------------------------
def _deferred_equals_immediate(stage: int, lamb: bool) -> tuple[bool, float | None]:
    model, opt = _zero(stage, lamb)
    immediate = train_losses(model, opt, FREEZE + 4, batch=BATCH, seq=SEQ)
    deferred_model, deferred_opt = _zero(stage, lamb, max_grad_norm=1e9)
    deferred = train_losses(deferred_model, deferred_opt, FREEZE + 4, batch=BATCH, seq=SEQ)
    same = immediate == deferred and all(torch.equal(a, b) for a, b in zip(_masters(model), _masters(deferred_model)))
    return same, deferred_model.zero_engine.reducer.last_grad_norm


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage,lamb", [(1, False), (2, False), (2, True)])
def test_exchanging_at_the_step_with_inactive_clipping_changes_nothing(stage: int, lamb: bool) -> None:
    for same, norm in run_distributed(_deferred_equals_immediate, 2, stage, lamb, timeout=200):
        assert same and norm is not None and 0 < norm < 1e9


def _flat(unit: object, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """A unit's gradients laid out as its ZeRO bucket (padded with zeros)."""
    flat = torch.zeros(unit.padded_numel)
    for slot in unit.slots:
        flat[slot.offset:slot.offset + slot.numel] = grads[slot.name].reshape(-1)
    return flat


def _clip_norm(units: list, grads: dict[str, torch.Tensor], warmup: bool) -> float:
    """The norm the ZeRO composition clips against, summed in the engine's order: during warm-up
    the averaged gradient's, from each rank's shard of each unit (squares summed in float64 as
    ``shard_sumsq`` sums them, ranks added last); after it ``sqrt(mean over ranks of ||local bucket||^2)``."""
    world = dist.get_world_size()
    if warmup:
        per_rank = [0.0] * world
        for unit in units:
            shards = _flat(unit, grads).view(world, unit.shard_numel)
            for rank in range(world):
                per_rank[rank] += float(shard_sumsq(shards[rank]))
        return math.sqrt(sum(per_rank))
    squares = torch.zeros(1, dtype=torch.float64)
    for unit in units:
        squares += float(torch.linalg.vector_norm(_flat(unit, grads))) ** 2
    dist.all_reduce(squares)
    return math.sqrt(float(squares) / world)


def _clipped_by_hand(model: nn.Module, opt: OnebitAdam, units: list, steps: int) -> list[float]:
    """Plain-data-parallel OnebitAdam with the clipping the ZeRO composition applies, by hand."""
    rank, world = dist.get_rank(), dist.get_world_size()
    named = dict(model.named_parameters())
    losses = []
    for step in range(steps):
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        loss.backward()
        losses.append(loss.item())
        grads = {name: p.grad for name, p in named.items()}
        warmup = step < FREEZE
        if warmup:  # OnebitAdam averages again: averaging equal values is exact at W=2
            average_gradients(list(grads.values()))
        norm = _clip_norm(units, grads, warmup)
        if norm > CLIP:
            for g in grads.values():
                g.mul_(CLIP / (norm + 1e-6))
        opt.step()
        opt.zero_grad()
    return losses


def _clipped_against_plain(stage: int) -> tuple[list[float], list[float], list[float], float]:
    model, opt = _zero(stage, max_grad_norm=CLIP)
    clipped = train_losses(model, opt, FREEZE + 5, batch=BATCH, seq=SEQ)
    units = model.zero_engine.units
    plain = _model()
    named = dict(plain.named_parameters())
    groups = [{"params": [named[slot.name] for slot in unit.slots]} for unit in units]
    # variance_floor=0: the published algorithm on both sides (with the floor: test_onebit_zero_variance_floor.py).
    plain_opt = OnebitAdam(groups, lr=1e-3, weight_decay=0.01,
                           config=OnebitAdamConfig(freeze_step=FREEZE, variance_floor=0))
    reference = _clipped_by_hand(plain, plain_opt, units, FREEZE + 5)
    unclipped_model, unclipped_opt = _zero(stage)
    unclipped = train_losses(unclipped_model, unclipped_opt, FREEZE + 5, batch=BATCH, seq=SEQ)
    ours = {slot.name: slot.param.detach() for unit in units for slot in unit.slots}
    worst = max(float((ours[name] - p.detach()).abs().max()) for name, p in named.items())
    return clipped, reference, unclipped, worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_equals_plain_onebit_adam_clipped_by_hand_bitwise(stage: int) -> None:
    for clipped, reference, unclipped, worst in run_distributed(_clipped_against_plain, 2, stage, timeout=250):
        assert clipped == reference and worst == 0.0
        assert max(abs(a - b) for a, b in zip(clipped, unclipped)) > 1e-3  # clipping did act


def _bytes_of_a_clipped_compressed_step() -> tuple[int, int]:
    model, opt = _zero(2, max_grad_norm=CLIP)
    train_losses(model, opt, FREEZE + 2, batch=BATCH, seq=SEQ)
    with ByteLedger() as ledger:
        train_losses(model, opt, 1, batch=BATCH, seq=SEQ, start=FREEZE + 2)
    units = model.zero_engine.units
    formula = exchange_nbytes([(u.shard_numel, len(u.slots)) for u in units], dist.get_world_size())
    gather = sum(unit.padded_numel * 4 for unit in units)  # exact fp32 post-step all-gather
    # + the engine's 16-byte norm all-reduce and the clipping's one float64 (8 bytes)
    return ledger.total(), formula + gather + 16 + 8


@pytest.mark.timeout(240)
def test_clipping_adds_eight_bytes_per_compressed_step() -> None:
    total, formula = run_distributed(_bytes_of_a_clipped_compressed_step, 2, timeout=200)[0]
    assert total == formula


# ---- skipped steps --------------------------------------------------------------------------------
SKIPS = (1, FREEZE + 2)  # one during warm-up, one after it


def _run_with_skips(stage: int, dtype: torch.dtype, lamb: bool, inject: bool) -> tuple[list[float], int, int, bool]:
    extra = {"compute_dtype": dtype, "loss_scale": 1024.0} if dtype == torch.float16 else {}
    model, opt = _zero(stage, lamb, **extra)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, untouched = [], True
    exchange = model.zero_engine.reducer
    for step in range(FREEZE + 5):
        if step in SKIPS and not inject:
            continue  # the batch never happened
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        hook = None
        if step in SKIPS and rank == 1 and dtype == torch.float16:
            # One tensor of one unit overflows on one rank (as an fp16 overflow does): the other
            # units' gradients are finite, and must not be exchanged into the error feedback either.
            hook = model.zero_engine.units[0].slots[0].param.register_hook(lambda g: g * float("inf"))
        elif step in SKIPS and rank == 1:
            loss = loss * float("inf")  # fp32: every gradient of one rank
        loss.backward()
        if hook is not None:
            hook.remove()
        before = [(s.worker_error.clone(), s.server_error.clone(), s.signs) for s in exchange.units.values()]
        opt.step()
        opt.zero_grad()
        if step in SKIPS:
            after = [(s.worker_error, s.server_error, s.signs) for s in exchange.units.values()]
            untouched &= all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] is b[2]
                             for a, b in zip(before, after))
        else:
            losses.append(loss.item())
    return losses, opt.skipped_steps, int(exchange.steps[0]), untouched


def _skip_pair(stage: int, dtype: torch.dtype, lamb: bool) -> tuple[tuple, tuple]:
    return _run_with_skips(stage, dtype, lamb, True), _run_with_skips(stage, dtype, lamb, False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,dtype,lamb", [(2, torch.float16, False), (1, torch.float16, False),
                                              (2, torch.float16, True), (2, torch.float32, False)])
def test_a_skipped_step_leaves_the_one_bit_state_untouched(stage: int, dtype: torch.dtype, lamb: bool) -> None:
    for (losses, skipped, steps, untouched), (clean, none_skipped, clean_steps, _) in run_distributed(
            _skip_pair, 2, stage, dtype, lamb, timeout=250):
        assert skipped == len(SKIPS) and none_skipped == 0
        assert steps == clean_steps == FREEZE + 5 - len(SKIPS)  # the freeze counter counts updates only
        assert untouched
        assert losses == clean and all(math.isfinite(x) for x in losses)


# ---- clip_grad_norm_ (Lightning's gradient_clip_val) --------------------------------------------
def _losses_clipping_by_hand(model: nn.Module, opt: object, steps: int) -> list[float]:
    """``train_losses``'s loop with ``opt.clip_grad_norm_(CLIP)`` between backward and step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        loss.backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # this rank's loss, as train_losses returns
    return losses


def _clip_grad_norm_after_warmup() -> tuple[bool, str]:
    configured_model, configured_opt = _zero(2, max_grad_norm=CLIP)
    configured = train_losses(configured_model, configured_opt, FREEZE + 3, batch=BATCH, seq=SEQ)
    by_hand_model, by_hand_opt = _zero(2, max_grad_norm=1e9)  # deferred, the bound given per step
    by_hand = _losses_clipping_by_hand(by_hand_model, by_hand_opt, FREEZE + 3)
    same = configured == by_hand and all(torch.equal(a, b) for a, b in
                                         zip(_masters(configured_model), _masters(by_hand_model)))
    model, opt = _zero(2)  # not deferred: after warm-up the request cannot be honoured
    try:
        _losses_clipping_by_hand(model, opt, FREEZE + 1)
    except RuntimeError as exc:
        return same, str(exc)
    return same, ""


@pytest.mark.timeout(240)
def test_clip_grad_norm_clips_the_deferred_exchange_and_is_refused_without_it() -> None:
    for same, refusal in run_distributed(_clip_grad_norm_after_warmup, 2, timeout=200):
        assert same  # clip_grad_norm_(CLIP) per step = ZeroConfig(max_grad_norm=CLIP), bitwise
        assert "clip_grad_norm_ after the 1-bit warm-up (freeze_step) cannot clip" in refusal
        assert "ZeroConfig(max_grad_norm=...)" in refusal
