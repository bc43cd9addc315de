"""max_grad_norm and dynamic loss scaling of 1-bit Adam and 1-bit LAMB in plain data parallel.

Warm-up: bit for bit DDP + torch.amp.GradScaler (unscale_, clip_grad_norm_, step, update) +
AdamW, including a step skipped for an inf on one rank. After the freeze: a step skipped for an
inf on one rank leaves the run bit for bit the run without that batch, clipping equals the rule
written by hand, and the overflow flag and norm cost 16 bytes a step.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives as C
from plait.kernels.testing import run_distributed
from plait.onebit_optim import LossScaling, OnebitAdam, OnebitAdamConfig, OnebitLamb, OnebitLambConfig, ZeroOneAdam
from plait.onebit_optim.exchange.compressed import average_gradients

MAX_NORM, LR, WD = 1.0, 1e-2, 0.01


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def local_loss(model: torch.nn.Module, batch: int, rank: int, poison: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s loss on batch ``batch``; infinite on rank 1 when ``batch == poison``."""
    gen = torch.Generator().manual_seed(1000 * batch + rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen) * (1 + batch % 3)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss * float("inf") if batch == poison and rank == 1 else loss


def one_thread(fn):
    @functools.wraps(fn)
    def wrapped(*args):
        torch.set_num_threads(1)  # a tiny model: more threads only contend
        return fn(*args)
    return wrapped


def _warmup_vs_ddp_gradscaler() -> dict:
    rank = dist.get_rank()
    ref = mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    model = mlp()
    opt = OnebitAdam(model.parameters(), lr=LR, weight_decay=WD, config=OnebitAdamConfig(
        freeze_step=100, max_grad_norm=MAX_NORM, loss_scaling=LossScaling(init_scale=2.0 ** 10, growth_interval=3)))
    norms, mismatches = [], []
    for batch in range(10):
        scaler.scale(local_loss(ddp, batch, rank, poison=4)).backward()
        scaler.unscale_(ref_opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        opt.scale_loss(local_loss(model, batch, rank, poison=4)).backward()
        opt.step()
        opt.zero_grad()
        if opt.loss_scale != scaler.get_scale():
            mismatches.append(f"batch {batch}: scale {opt.loss_scale} != {scaler.get_scale()}")
        mismatches += [f"batch {batch}: parameter {i}" for i, (a, b) in enumerate(zip(model.parameters(),
                                                                                      ref.parameters()))
                       if not torch.equal(a, b)]
    return {"mismatches": mismatches, "norms": norms, "steps": opt.step_count, "scale": opt.loss_scale}


@one_thread
def _all_checks() -> dict:
    """The three W=2 checks in one launch (starting processes is most of their cost)."""
    return {"warmup": _warmup_vs_ddp_gradscaler(), "skips": _skips_against_runs_without_the_batch(),
            "clip": _clip_after_freeze_by_hand()}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_all_checks, 2, timeout=180)


def test_warmup_is_ddp_gradscaler_clip_adamw_bit_for_bit_with_a_skipped_step(ranks):
    for out in (r["warmup"] for r in ranks):
        assert out["mismatches"] == []
        assert out["steps"] == 9  # batch 4 (inf on rank 1) skipped on both ranks
        finite = [n for n in out["norms"] if math.isfinite(n)]
        assert min(finite) < MAX_NORM < max(finite)  # clipping both active and inactive
        # 2^10, halved at the skip, doubled after 3 taken steps in a row (twice): 2^11.
        assert out["scale"] == 2.0 ** 11


def _skip_run(kind: str, batches: list[int], poison: int | None) -> dict:
    rank = dist.get_rank()
    model = mlp()
    cls, cfg = (OnebitAdam, OnebitAdamConfig) if kind == "adam" else (OnebitLamb, OnebitLambConfig)
    opt = cls(model.parameters(), lr=LR, weight_decay=WD,
              config=cfg(freeze_step=3, max_grad_norm=MAX_NORM, loss_scaling=LossScaling(init_scale=2.0 ** 10)))
    per_step = []
    for batch in batches:
        opt.scale_loss(local_loss(model, batch, rank, poison)).backward()
        with C.ByteLedger() as ledger:
            opt.step()
        opt.zero_grad()
        per_step.append(ledger.total())
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": opt.step_count,
            "bytes": per_step, "numel": sum(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters()))}


def _skips_against_runs_without_the_batch() -> list[str]:
    # Batch 1 is poisoned in warm-up, batch 7 after the freeze (rank 1 only). Scales are powers of
    # two, so gradients unscale exactly whatever the scale: the runs must be bitwise equal.
    batches, problems = list(range(11)), []
    for kind in ("adam", "lamb"):
        for poison in (1, 7):
            got = _skip_run(kind, batches, poison)
            want = _skip_run(kind, [b for b in batches if b != poison], None)
            if not got["steps"] == want["steps"] == 10:
                problems.append(f"{kind} poison {poison}: steps {got['steps']} / {want['steps']}")
            if not all(torch.equal(a, b) for a, b in zip(got["params"], want["params"])):
                problems.append(f"{kind} poison {poison}: parameters differ from the run without the batch")
        n, tensors = want["numel"], want["tensors"]
        compressed = C.compressed_allreduce_nbytes(C.compressed_numel(n, 2), 2) + 4 * tensors
        # Warm-up: the gradient all-reduce only; after it: the 1-bit exchange + 16 bytes (flag and norm).
        if want["bytes"] != [4 * n] * 3 + [compressed + 16] * 7:
            problems.append(f"{kind}: bytes {want['bytes']}, formula {4 * n} x 3, {compressed + 16} x 7")
    return problems


def test_a_skipped_step_in_warm_up_or_after_the_freeze_is_the_run_without_that_batch(ranks):
    for problems in (r["skips"] for r in ranks):
        assert problems == []


def _clip_after_freeze_by_hand() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, hand = mlp(), mlp()
    opt = OnebitAdam(model.parameters(), lr=LR, config=OnebitAdamConfig(freeze_step=2, max_grad_norm=MAX_NORM))
    hand_opt = OnebitAdam(hand.parameters(), lr=LR, config=OnebitAdamConfig(freeze_step=2))
    mismatches, clipped = [], 0
    for batch in range(8):
        local_loss(model, batch, rank).backward()
        local_loss(hand, batch, rank).backward()
        grads = [p.grad for p in hand.parameters()]
        if batch < 2:  # warm-up: clip the average (averaging it again in step is exact at W=2)
            average_gradients(grads)
            torch.nn.utils.clip_grad_norm_(hand.parameters(), MAX_NORM)
        else:  # after the freeze: the RMS over ranks of the local norms
            total = torch.stack([g.double().square().sum() for g in grads]).sum()
            dist.all_reduce(total)
            norm = math.sqrt(float(total) / world)
            if norm > MAX_NORM:
                clipped += 1
                for g in grads:
                    g.mul_(MAX_NORM / (norm + 1e-6))
        opt.step()
        hand_opt.step()
        opt.zero_grad()
        hand_opt.zero_grad()
        mismatches += [f"batch {batch} parameter {i}" for i, (a, b) in enumerate(zip(model.parameters(),
                                                                                     hand.parameters()))
                       if not torch.equal(a, b)]
    return mismatches + ([] if clipped else ["clipping never active after the freeze"])


def test_clipping_after_the_freeze_is_the_rms_norm_rule_written_by_hand(ranks):
    for mismatches in (r["clip"] for r in ranks):
        assert mismatches == []


@pytest.mark.parametrize(("build", "match"), [
    (lambda: OnebitAdamConfig(max_grad_norm=0), "OnebitAdamConfig.max_grad_norm=0 must be None"),
    (lambda: OnebitLambConfig(max_grad_norm=float("inf")), "OnebitLambConfig.max_grad_norm=inf"),
    (lambda: OnebitAdamConfig(loss_scaling=65536), "OnebitAdamConfig.loss_scaling=65536 must be None or a LossScaling"),
    (lambda: LossScaling(init_scale=-1), "LossScaling.init_scale=-1"),
    (lambda: LossScaling(growth_factor=1), "LossScaling.growth_factor=1 must be a finite number > 1"),
    (lambda: LossScaling(backoff_factor=1.5), r"LossScaling.backoff_factor=1.5 must be in \(0, 1\)"),
    (lambda: LossScaling(growth_interval=0), "LossScaling.growth_interval=0 must be an integer >= 1"),
])
def test_bad_settings_are_refused_naming_the_field(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_scale_loss_without_loss_scaling_names_the_fix_and_zero_refuses_both():
    from plait.onebit_optim.under_zero.compose import compose_with_zero

    opt = OnebitAdam(mlp().parameters())
    with pytest.raises(RuntimeError, match=r"config.loss_scaling is None; pass OnebitAdamConfig\(loss_scaling="):
        opt.scale_loss(torch.tensor(1.0))
    assert opt.loss_scale == 1.0 and ZeroOneAdam(mlp().parameters()).loss_scale == 1.0

    class Stage2:
        stage = 2
        zeropp = None

    for config, field in ((OnebitAdamConfig(max_grad_norm=1.0), "max_grad_norm"),
                          (OnebitAdamConfig(loss_scaling=LossScaling()), "loss_scaling")):
        with pytest.raises(ValueError, match=f"OnebitAdamConfig.{field} is for plain data parallel"):
            compose_with_zero(OnebitAdam, Stage2(), param_groups=None, reducer=None, onebit_config=config)
