"""``freeze_step="auto"`` for 1-bit Adam and 1-bit LAMB under ZeRO-2 (tiny-llama, gloo, W=2).

Under ZeRO a tensor's variance is spread over the shards of its unit; each rank sums its pieces
per tensor and one float64 all-reduce completes the sums (:mod:`plait.onebit_optim.under_zero.settle`).
The warm-up is plain Adam (LAMB) on averaged gradients, so the variance, and the step "auto"
chooses, must be plain data parallel's. Checked here:

* the step ZeRO-2 chooses equals the one plain data-parallel 1-bit Adam (and 1-bit LAMB) with
  "auto" chooses on the same model and data, on both ranks;
* the losses equal ZeRO-2 with that integer ``freeze_step`` bit for bit;
* bytes: ``8 x tensors`` more per warm-up step than that integer run, except over its last
  ``window + 1`` warm-up steps, where the integer run observes too (for the early-freeze
  warning), and nothing after the freeze;
* a fixed ``freeze_step`` before the variance settled warns once under ZeRO; the settled one not;
* a universal checkpoint saved mid-warm-up resumes to the same freeze step and losses, bitwise.

The settle window is shortened (2 steps, threshold 0.25) so the variance of tiny-llama at lr 1e-3
settles within a dozen steps; the statistic falls through 0.27 (step 9) to 0.24 (step 10) there.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from plait import universal_ckpt
from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import run_distributed, tiny_llama, train_losses
from plait.onebit_optim import OnebitAdam, OnebitAdamConfig, OnebitLamb, OnebitLambConfig, SettleConfig
from plait.onebit_optim.under_zero.settle import settle_nbytes
from plait.zero_sharding import ZeroConfig, zero_shard

BATCH, SEQ, STEPS, BUCKET = 8, 32, 13, 150_000
SETTLE = SettleConfig(threshold=0.25, window=2, min_step=3, max_step=STEPS)
CONFIGS = {OnebitAdam: OnebitAdamConfig, OnebitLamb: OnebitLambConfig}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return tiny_llama(num_layers=2, hidden_size=64, num_heads=2)


def _config(optimizer: type, freeze: int | str) -> OnebitAdamConfig | OnebitLambConfig:
    return CONFIGS[optimizer](freeze_step=freeze, settle=SETTLE, variance_floor=0)


def _zero(freeze: int | str, optimizer: type = OnebitAdam) -> tuple[nn.Module, object]:
    return zero_shard(_model(), optimizer, ZeroConfig(stage=2, reduce_bucket_elements=BUCKET), lr=1e-3,
                      weight_decay=0.01, onebit_config=_config(optimizer, freeze))


def _per_step(model: nn.Module, opt: object, steps: int, start: int = 0) -> tuple[list[float], list[int]]:
    """Losses and the logical bytes this rank recorded, per step."""
    losses, nbytes = [], []
    for step in range(start, start + steps):
        with ByteLedger() as ledger:
            losses += train_losses(model, opt, 1, batch=BATCH, seq=SEQ, start=step)
        nbytes.append(ledger.total())
    return losses, nbytes


class _Warnings(logging.Handler):
    """Collects the WARNINGs of the ``plait.onebit_optim`` logger while in a ``with`` block."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Warnings:
        logging.getLogger("plait.onebit_optim").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("plait.onebit_optim").removeHandler(self)


def _adam_against_plain_and_fixed() -> dict:
    plain = _model()
    plain_opt = OnebitAdam(plain.parameters(), lr=1e-3, weight_decay=0.01, config=_config(OnebitAdam, "auto"))
    train_losses(plain, plain_opt, STEPS, batch=BATCH, seq=SEQ)
    model, opt = _zero("auto")
    auto_losses, auto_bytes = _per_step(model, opt, STEPS)
    chosen = model.zero_engine.reducer.freeze_step
    with _Warnings() as settled:  # a fixed step where the variance has settled: no warning
        fixed_model, fixed_opt = _zero(chosen)
        fixed_losses, fixed_bytes = _per_step(fixed_model, fixed_opt, STEPS)
    with _Warnings() as early:
        early_model, early_opt = _zero(2)
        train_losses(early_model, early_opt, 3, batch=BATCH, seq=SEQ)
    return {"plain": plain_opt.freeze_step, "zero": chosen, "auto": auto_losses, "fixed": fixed_losses,
            "auto_bytes": auto_bytes, "fixed_bytes": fixed_bytes,
            "tensors": sum(len(unit.slots) for unit in model.zero_engine.units),
            "early": early.messages, "settled": settled.messages}


@pytest.mark.timeout(120)
def test_auto_under_zero2_chooses_plain_data_parallels_step_and_equals_that_fixed_step() -> None:
    ranks = run_distributed(_adam_against_plain_and_fixed, 2, timeout=110)
    first = ranks[0]
    chosen = first["zero"]
    assert [r["zero"] for r in ranks] == [chosen] * 2
    assert chosen == first["plain"]
    assert SETTLE.min_step < chosen < STEPS  # decided by the statistic, with compressed steps after it
    for r in ranks:
        assert r["auto"] == r["fixed"]  # bitwise, warm-up and compressed steps
        # One float64 sum per tensor per observed warm-up step; the fixed run observes its last
        # window + 1 warm-up steps too (the early-freeze warning), and neither observes after.
        extra = [a - f for a, f in zip(r["auto_bytes"], r["fixed_bytes"])]
        watched_by_fixed = chosen - SETTLE.window
        assert extra == ([settle_nbytes(r["tensors"])] * (watched_by_fixed - 1)
                         + [0] * (STEPS - watched_by_fixed + 1)), extra
    assert settle_nbytes(first["tensors"]) == 8 * first["tensors"]
    early = first["early"]
    assert len(early) == 1 and "OnebitAdam under ZeRO: freeze_step=2 freezes the variance before it has settled" \
        in early[0], early
    assert first["settled"] == []


K = 6  # mid-warm-up: more observations than the window keeps


def _lamb_and_resume(root: str) -> dict:
    plain = _model()
    plain_opt = OnebitLamb(plain.parameters(), lr=1e-3, weight_decay=0.01, config=_config(OnebitLamb, "auto"))
    train_losses(plain, plain_opt, STEPS, batch=BATCH, seq=SEQ)
    lamb, lamb_opt = _zero("auto", OnebitLamb)
    train_losses(lamb, lamb_opt, STEPS, batch=BATCH, seq=SEQ)
    # 1-bit Adam saved mid-warm-up, continued; then a fresh model loads the checkpoint and continues.
    model, opt = _zero("auto")
    train_losses(model, opt, K, batch=BATCH, seq=SEQ)
    universal_ckpt.save({"model": model}, root, step=K)
    uninterrupted = train_losses(model, opt, STEPS - K, batch=BATCH, seq=SEQ, start=K)
    resumed_model, resumed_opt = _zero("auto")
    universal_ckpt.load({"model": resumed_model}, root)
    resumed = train_losses(resumed_model, resumed_opt, STEPS - K, batch=BATCH, seq=SEQ, start=K)
    return {"lamb": (plain_opt.freeze_step, lamb.zero_engine.reducer.freeze_step),
            "uninterrupted": (uninterrupted, model.zero_engine.reducer.freeze_step),
            "resumed": (resumed, resumed_model.zero_engine.reducer.freeze_step)}


@pytest.mark.timeout(120)
def test_lamb_chooses_plain_data_parallels_step_and_a_mid_warmup_checkpoint_resumes_bitwise(tmp_path) -> None:
    ranks = run_distributed(_lamb_and_resume, 2, str(tmp_path / "ckpt"), timeout=110)
    plain_lamb = ranks[0]["lamb"][0]
    assert plain_lamb is not None and SETTLE.min_step <= plain_lamb < STEPS
    for r in ranks:
        assert r["lamb"] == (plain_lamb, plain_lamb)
        assert r["uninterrupted"][1] is not None and r["uninterrupted"][1] > K
        assert r["resumed"] == r["uninterrupted"]  # the same freeze step, the same losses bit for bit
