"""``plait bench deepspeed-shim``: the same DeepSpeed script under DeepSpeed and under plait's shim.

``run(quick)`` follows the ``plait.benchmarks`` convention. One world-size-2 call (gloo, one
thread per rank) runs the script of :mod:`.shim_worker` for each example config (ZeRO-2, ZeRO-3,
ZeRO-3 + CPU offload), DeepSpeed 0.19.8 and plait alternating steps ABBA, and turns rank 0's
figures into rows per config:

* step time (wall clock; every step synchronises the ranks): plait / DeepSpeed, target
  ``<= 0.8``, PASS only by the p90 of the round-by-round ratio;
* step CPU time of the training thread (informational: less sensitive to other jobs than wall
  time, but it leaves out gloo's own threads);
* losses: the largest relative difference over every step of both ranks (warm-up and timed), target
  ``<= 1e-5``.

Quick mode: the 2-layer tiny-llama (vocab 1024), global batch 4 x 32 tokens, 2 warm-up and 10
timed steps. Full: tiny-llama (8.4M), global batch 8 x 64 tokens, 3 warm-up and 17 timed steps (20
losses per side and rank).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from plait.kernels.bench import BenchRow, timing_row
from plait.kernels.testing import run_distributed
from plait.zero_sharding.benchmarks.shim_worker import ShimJob, run_shim

ENV = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator (the ranks inherit it)
STEP_TARGET = 0.8  # plait's step time over DeepSpeed's, by the ratio's p90
LOSS_TARGET = 1e-5  # relative


def job_for(quick: bool) -> ShimJob:
    """The job ``run`` measures (see the module docstring)."""
    if quick:
        return ShimJob(model="tiny-llama-2l", warmup=2, steps=10, batch=4, seq=32)
    return ShimJob()


def loss_row(tag: str, per_rank: list[dict[str, Any]]) -> BenchRow:
    """The losses of both sides on every rank: the largest relative difference against the target.

    Args:
        tag: the row's benchmark name.
        per_rank: each rank's :func:`~.shim_worker.measure` result for one config.
    """
    worst, count = 0.0, 0
    for result in per_rank:
        ours, theirs = result["losses"]["plait"], result["losses"]["DeepSpeed"]
        if len(ours) != len(theirs):
            return BenchRow(benchmark=tag, figure="loss rel. diff (max)", ours=float("nan"), peer="DeepSpeed",
                            target=f"<= {LOSS_TARGET:g}", passed=False,
                            note=f"step counts differ: plait {len(ours)}, DeepSpeed {len(theirs)}")
        for a, b in zip(ours, theirs, strict=True):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        count = len(ours)
    first, last = per_rank[0]["losses"]["DeepSpeed"][0], per_rank[0]["losses"]["DeepSpeed"][-1]
    return BenchRow(benchmark=tag, figure="loss rel. diff (max)", ours=worst, peer="DeepSpeed",
                    target=f"<= {LOSS_TARGET:g}", passed=worst <= LOSS_TARGET,
                    note=f"{count} steps x {len(per_rank)} ranks; DeepSpeed loss first/last {first:.4f}/{last:.4f}")


def config_rows(tag: str, per_rank: list[dict[str, Any]]) -> list[BenchRow]:
    """Rows of one config: wall step time (targeted), thread CPU time, losses.

    Args:
        tag: the row's benchmark name.
        per_rank: each rank's :func:`~.shim_worker.measure` result for this config.
    """
    rank0 = per_rank[0]
    wall = timing_row(tag, rank0["wall"]["plait"], "DeepSpeed", rank0["wall"]["DeepSpeed"],
                      target_ratio=STEP_TARGET, figure="step time (ms)")
    cpu = timing_row(tag, rank0["cpu"]["plait"], "DeepSpeed", rank0["cpu"]["DeepSpeed"],
                     figure="step thread CPU (ms)")
    return [wall, cpu, loss_row(tag, per_rank)]


def run(quick: bool) -> list[BenchRow]:
    """Run the suite (see the module docstring).

    Args:
        quick: the short version (2-layer model, fewer steps).

    Returns:
        Three rows per config: step time, thread CPU time, losses.
    """
    job = job_for(quick)
    start = time.perf_counter()
    per_rank = run_distributed(run_shim, 2, job, timeout=600 if quick else 1800, env=ENV)
    label = "tiny-llama(2 layers, vocab 1024)" if job.model == "tiny-llama-2l" else job.model
    rows: list[BenchRow] = []
    for name in job.configs:
        rows += config_rows(f"{label} W=2 {name}", [result[name] for result in per_rank])
    print(f"deepspeed-shim: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows
