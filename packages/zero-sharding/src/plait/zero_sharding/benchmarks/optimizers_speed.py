"""The speed part of ``plait bench optimizers``: the Muon + AdamW step under ZeRO against peers.

At W ranks (gloo, one torch thread per rank) and ZeRO stages 2 and 3, the optimizer step of
plait's ``MuonWithAdamW`` under ZeRO is timed round by round against

* **one process x W**: every rank stepping the same optimizer over a whole, unsharded replica of
  the model (what each rank does without ZeRO, as with DDP); ZeRO's owners split the
  Newton-Schulz work instead, at the price of the step's gather and broadcasts;
* **DeepSpeed's Muon** (``"optimizer": {"type": "Muon"}``, its ``MuonWithAuxAdam``, torch's
  AdamW for the auxiliary half since DeepSpeed's fused Adam is a CUDA extension, and its
  ``torch.compile``-wrapped update run eager) at the same ZeRO stage, ``engine.step()``, where it
  runs on CPU; where it does not, the row says why.

Each round first runs every contender's forward and backward (untimed), then times the steps in
ABBA order (A B C, then C B A, ...), with a barrier before and after each, on rank 0's clock: a
step's time is that of the slowest rank, and a drift of the machine's load falls on every
contender alike. Rows come from :func:`plait.kernels.bench.timing_row`, which passes a row only
when the p90 of the round-by-round ratio meets the target.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.bench import BenchRow, TimingStats, timing_row
from plait.kernels.testing import global_batch, rank_slice, tiny_llama

BATCH, SEQ = 8, 64
MUON = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.1)
WARMUP = 2  # untimed rounds: the first steps allocate optimizer state
ALONE = "one process x W"
DEEPSPEED = "DeepSpeed 0.19.8 Muon"
TARGET = 1.0
TRAIN_FIGURE = "fwd + bwd + step (ms)"
# DeepSpeed orthogonalises while it reduces gradients (in backward), so only whole training steps compare.
PEER_NOTE = {2: "; DeepSpeed runs Newton-Schulz in its backward's reduction, hence whole steps",
             3: "; DeepSpeed with reduce_scatter off (its Muon refuses it); Newton-Schulz in its backward"}


def _batch(step: int) -> dict[str, torch.Tensor]:
    return rank_slice(global_batch(step, BATCH, SEQ), dist.get_rank(), dist.get_world_size())


def _plait(shape: dict[str, Any], stage: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(backward of a step, optimizer step) of plait ZeRO at ``stage`` with Muon + AdamW."""
    from plait.zero_sharding import MuonWithAdamW, ZeroConfig, muon_param_groups, zero_shard

    torch.manual_seed(0)
    model = tiny_llama(**shape)
    model, optimizer = zero_shard(model, MuonWithAdamW, ZeroConfig(stage=stage),
                                  param_groups=muon_param_groups(model), **MUON)

    def backward(step: int) -> None:
        optimizer.zero_grad()
        model(**_batch(step)).loss.backward()

    return backward, optimizer.step


def _alone(shape: dict[str, Any]) -> Callable[[], None]:
    """The optimizer step over a whole replica; its gradients, set once, stay for every step."""
    from plait.zero_sharding import MuonWithAdamW, muon_param_groups

    torch.manual_seed(0)
    model = tiny_llama(**shape)
    optimizer = MuonWithAdamW(muon_param_groups(model), **MUON)
    model(**_batch(0)).loss.backward()
    return optimizer.step


def _deepspeed(shape: dict[str, Any], stage: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(backward of a step, ``engine.step()``) of DeepSpeed's Muon at ``stage``.

    Raises:
        Exception: whatever DeepSpeed raises where it cannot run (the caller reports it).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed wraps its Muon update in torch.compile; inductor's C++ build of it took over five
    # minutes per rank on 2 shared cores, so its update runs eager (no compilation anywhere here).
    torch._dynamo.config.disable = True
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo, as for plait
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the process group that already exists
    torch.manual_seed(0)
    model = tiny_llama(**shape)
    params = {"lr": MUON["lr"], "adam_lr": MUON["adamw_lr"], "weight_decay": MUON["weight_decay"],
              "torch_adam": True}
    config = {"train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(), "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "optimizer": {"type": "Muon", "params": params},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "reduce_scatter": stage != 3}}  # ZeRO-3 Muon refuses reduce_scatter
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def backward(step: int) -> None:
        engine.backward(engine(**_batch(step)).loss)

    return backward, engine.step


def _timed(fn: Callable[[], object]) -> float:
    """Seconds of ``fn`` between two barriers, on this rank's clock: the slowest rank's time."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rounds(contenders: dict[str, tuple[Callable[[int], None] | None, Callable[[], None]]],
            rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per contender, the seconds of its optimizer step (``"step"``) and, where it has a backward,
    of the whole training step (``"train"``: forward, backward and step, a barrier between
    backward and step), in ABBA order over the contenders."""
    names = list(contenders)
    out: dict[str, dict[str, list[float]]] = {name: {"step": [], "train": []} for name in names}
    for round_ in range(WARMUP + rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            backward, step = contenders[name]
            pass_ = _timed(lambda: backward(round_)) if backward is not None else 0.0  # noqa: B023
            update = _timed(step)
            if round_ >= WARMUP:
                out[name]["step"].append(update)
                if backward is not None:
                    out[name]["train"].append(pass_ + update)
    return out


def speed_ranks(setup: dict[str, Any]) -> dict[str, Any]:
    """On every rank: each stage's step seconds per contender, and why DeepSpeed could not run.

    Args:
        setup: ``{"model": tiny-llama overrides, "timed": rounds}``.

    Returns:
        ``{"ZeRO-2": {name: {"step": [s], "train": [s]}}, "ZeRO-3": ..., "deepspeed_error":
        {stage: reason}}``.
    """
    out: dict[str, Any] = {"deepspeed_error": {}}
    for stage in (2, 3):
        contenders: dict[str, Any] = {"plait": _plait(setup["model"], stage), ALONE: (None, _alone(setup["model"]))}
        try:
            contenders[DEEPSPEED] = _deepspeed(setup["model"], stage)
        except Exception as error:  # noqa: BLE001 - the row reports whatever stops DeepSpeed
            out["deepspeed_error"][stage] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            dist.barrier()  # a rank that failed must not leave the others in a collective alone
        out[f"ZeRO-{stage}"] = _rounds(contenders, setup["timed"])
    return out


def speed_rows(found: dict[str, Any], where: str, world: int) -> list[BenchRow]:
    """Rows of one world size: plait against one process x W and against DeepSpeed, per stage.

    Args:
        found: rank 0's :func:`speed_ranks` result.
        where: the model's description.
        world: the world size.

    Returns:
        Two rows per stage: plait's optimizer step against one process x W, and plait's whole
        training step against DeepSpeed's (n/a with the reason where DeepSpeed did not run).
    """
    rows = []
    for stage in (2, 3):
        times = found[f"ZeRO-{stage}"]
        name = f"{where}: Muon + AdamW, ZeRO-{stage} W={world}"
        rows.append(timing_row(name, TimingStats.of(times["plait"]["step"]), f"{ALONE} (replicated)",
                               TimingStats.of(times[ALONE]["step"]), target_ratio=TARGET,
                               figure="optimizer step (ms)"))
        train = TimingStats.of(times["plait"]["train"])
        peer = f"{DEEPSPEED} ZeRO-{stage}"
        if DEEPSPEED in times:
            row = timing_row(name, train, peer, TimingStats.of(times[DEEPSPEED]["train"]), target_ratio=TARGET,
                             figure=TRAIN_FIGURE)
            rows.append(dataclasses.replace(row, note=row.note + PEER_NOTE[stage]))
        else:
            reason = found["deepspeed_error"].get(stage, "not run")
            rows.append(BenchRow(benchmark=name, figure=TRAIN_FIGURE, ours=train.median * 1e3, peer=peer,
                                 note=f"DeepSpeed did not run on CPU: {reason}"))
    return rows
