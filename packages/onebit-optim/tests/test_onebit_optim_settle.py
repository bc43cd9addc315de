"""freeze_step="auto" and the early-freeze warning, on the unseen-rows LM of the variance-floor tests.

The oracle is DDP + AdamW (and plain LAMB) with the statistic computed by hand: the 1-bit
optimizers' warm-up is that optimizer bit for bit, so "auto" must freeze exactly after the first
step ``>= min_step`` at which the oracle's variance has settled.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives as C
from plait.kernels.testing import run_distributed
from plait.onebit_optim import (
    Lamb,
    OnebitAdam,
    OnebitAdamConfig,
    OnebitLamb,
    OnebitLambConfig,
    SettleConfig,
    config_from_dict,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_onebit_optim_variance_floor import BATCH, LR, SEQ, VOCAB, WideVocabLM

STEPS = 36
SETTLE = SettleConfig()


def batch_loss(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    ids = ids[rank * BATCH // world:(rank + 1) * BATCH // world]
    return torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def hand_change(states: list[dict], history: list[list[float]], step: int, beta2: float = 0.999) -> float | None:
    """The settle statistic written plainly: max over tensors of |s(t) - s(t-k)| / s(t)."""
    history.append([float(s["exp_avg_sq"].double().sum()) / (1 - beta2 ** step) for s in states])
    k = min(SETTLE.window, step - 1)
    if k == 0:
        return None
    new, old = history[-1], history[-1 - k]
    return max(abs(n - o) / n for n, o in zip(new, old) if n > 0)


def expected_freeze(changes: list[float | None]) -> int:
    for step, change in enumerate(changes, 1):
        if step >= SETTLE.min_step and change is not None and change <= SETTLE.threshold:
            return step
    raise AssertionError(f"the oracle's variance never settled in {len(changes)} steps: {changes}")


def train(make, steps: int, oracle: bool) -> dict:
    """Per-step global mean losses, the optimizer's freeze step and (oracle) the hand statistic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: two threads only contend (and for the cores of a busy machine)
    try:
        return _train(make, steps, oracle)
    finally:
        torch.set_num_threads(threads)


def _train(make, steps: int, oracle: bool) -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = WideVocabLM()
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if oracle and world > 1 else model
    optimizer = make(model.parameters())
    losses, changes, history = [], [], []
    for step in range(1, steps + 1):
        loss = batch_loss(wrapped, step, rank, world)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if oracle:
            changes.append(hand_change([optimizer.state[p] for p in model.parameters()], history, step))
        report = loss.detach().clone()
        if world > 1:
            dist.all_reduce(report)
        losses.append(report.item() / world)
    return {"losses": losses, "changes": changes, "freeze": getattr(optimizer, "freeze_step", None)}


def _auto_adam() -> dict:
    adamw = train(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0), STEPS, oracle=True)
    with C.ByteLedger() as ledger:
        auto = train(lambda ps: OnebitAdam(ps, lr=LR, config=OnebitAdamConfig(freeze_step="auto")), STEPS, False)
    auto["bytes"] = ledger.total()
    return {"adamw": adamw, "auto": auto}


def tail(losses: list[float]) -> float:
    return sum(losses[-5:]) / 5


def test_auto_freezes_when_the_variance_has_settled_the_same_on_every_rank_and_trains():
    ranks = run_distributed(_auto_adam, 2, timeout=120)
    adamw, auto = ranks[0]["adamw"], ranks[0]["auto"]
    assert [r["auto"]["freeze"] for r in ranks] == [auto["freeze"]] * 2
    assert auto["freeze"] == expected_freeze(adamw["changes"]), (auto["freeze"], adamw["changes"])
    assert auto["freeze"] < STEPS - 5  # the compressed phase is part of the run measured below
    # The decision is local (equal variances on every rank): not one byte more than a fixed freeze
    # step moves, one fp32 gradient all-reduce per warm-up step (one bucket) and the 1-bit exchange after.
    numel, tensors = sum(p.numel() for p in WideVocabLM().parameters()), len(list(WideVocabLM().parameters()))
    compressed = C.compressed_allreduce_nbytes(C.compressed_numel(numel, 2), 2) + 4 * tensors
    assert auto["bytes"] == auto["freeze"] * 4 * numel + (STEPS - auto["freeze"]) * compressed
    assert all(math.isfinite(x) for x in auto["losses"])
    assert abs(tail(auto["losses"]) / tail(adamw["losses"]) - 1) <= 0.02, (auto["losses"], adamw["losses"])


def test_auto_for_onebit_lamb_freezes_on_lambs_settled_variance_and_stays_within_2_percent():
    lamb = train(lambda ps: Lamb(ps, lr=LR), STEPS, oracle=True)
    auto = train(lambda ps: OnebitLamb(ps, lr=LR, config=OnebitLambConfig(freeze_step="auto")), STEPS, False)
    assert auto["freeze"] == expected_freeze(lamb["changes"])
    assert abs(tail(auto["losses"]) / tail(lamb["losses"]) - 1) <= 0.02, (auto["losses"], lamb["losses"])


def test_a_fixed_freeze_before_the_variance_settled_warns_once_with_the_measured_change(caplog):
    changes = train(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0), STEPS, oracle=True)["changes"]
    with caplog.at_level(logging.WARNING, logger="plait.onebit_optim"):
        train(lambda ps: OnebitAdam(ps, lr=LR, config=OnebitAdamConfig(freeze_step=2)), 6, False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "OnebitAdam: freeze_step=2 freezes the variance before it has settled" in warnings[0]
    assert f"over the last 1 step(s) is {changes[1]:.3g}" in warnings[0]
    assert changes[1] > SETTLE.threshold
    caplog.clear()
    settled = expected_freeze(changes)  # a fixed step where the variance has settled: no warning
    with caplog.at_level(logging.WARNING, logger="plait.onebit_optim"):
        train(lambda ps: OnebitAdam(ps, lr=LR, config=OnebitAdamConfig(freeze_step=settled)), settled + 2, False)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == []


def test_auto_resumes_mid_warm_up_to_the_same_decision_bit_for_bit():
    def run(stop_at: int | None) -> tuple[int, list[torch.Tensor]]:
        model = WideVocabLM()
        opt = OnebitAdam(model.parameters(), lr=LR, config=OnebitAdamConfig(freeze_step="auto"))
        for step in range(1, 26):
            if step == stop_at:  # a new model and optimizer from the saved state
                saved_model, saved_opt = model.state_dict(), opt.state_dict()
                model = WideVocabLM()
                model.load_state_dict(saved_model)
                opt = OnebitAdam(model.parameters(), lr=LR, config=OnebitAdamConfig(freeze_step="auto"))
                opt.load_state_dict(saved_opt)
            batch_loss(model, step, 0, 1).backward()
            opt.step()
            opt.zero_grad()
        return opt.freeze_step, [p.detach().clone() for p in model.parameters()]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (freeze, params), (resumed_freeze, resumed) = run(None), run(15)
    finally:
        torch.set_num_threads(threads)
    assert freeze is not None and resumed_freeze == freeze
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


@pytest.mark.parametrize(("build", "match"), [
    (lambda: OnebitAdamConfig(freeze_step=0), "OnebitAdamConfig.freeze_step=0 must be an integer >= 1 or 'auto'"),
    (lambda: OnebitLambConfig(freeze_step="soon"), "OnebitLambConfig.freeze_step='soon'"),
    (lambda: OnebitAdamConfig(settle={"threshold": 0.1}), "OnebitAdamConfig.settle=.* must be a SettleConfig"),
    (lambda: SettleConfig(threshold=0), "SettleConfig.threshold=0 must be a finite number > 0"),
    (lambda: SettleConfig(window=0), "SettleConfig.window=0 must be an integer >= 1"),
    (lambda: SettleConfig(window=10, min_step=5), r"SettleConfig.min_step=5 must be an integer >= 11 \(window"),
    (lambda: SettleConfig(min_step=50, max_step=40), r"SettleConfig.max_step=40 must be an integer >= 50"),
])
def test_bad_settings_are_refused_naming_the_field(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_settle_block_translates_from_a_config_file():
    config = config_from_dict("OnebitAdam", {"freeze_step": "auto", "settle": {"threshold": 0.05, "window": 4}})
    assert config.settle == SettleConfig(threshold=0.05, window=4)

