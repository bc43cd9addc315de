"""``plait bench parallel-3d``: plait ZeRO composed with torch's tensor and pipeline parallelism
(3-D parallelism, as BLOOM-176B was trained), on CPU with gloo, against one process and against
FSDP2 x TP x pipelining on the same mesh.

A small BLOOM-shaped decoder (:mod:`.parallel_3d_model`: fused head-major QKV, RoPE, 4x GELU MLP)
trains at three layouts: W=4 ``dp2 x tp2`` and ``dp2 x pp2``, W=8 ``dp2 x pp2 x tp2``
(:mod:`.parallel_3d_worker`). Rows per layout:

* losses: the largest relative difference over the steps from one process training the whole
  decoder on the whole batch (target <= 1e-5), plait and FSDP2;
* model-state bytes per rank (plait ZeRO-2, fp32 AdamW) against the 3-D formula: each rank's
  stage's TP shard, ``4`` bytes whole plus ``12`` per element of its ``1/dp`` shard, padded per
  unit, plus a step counter per unit; exact on every rank;
* one step's communication bytes per mesh dimension against the formula (``dp``: ZeRO-2's
  reduce-scatter and all-gather per unit; ``tp``: Megatron's four all-reduces per block and row;
  ``pp``: a stage's activations forward and gradients back); exact on every rank;
* step time against FSDP2 on the same mesh, the two alternating step by step (A B B A), rank 0's
  clock between barriers after the warm-up; the target (<= 1.0) holds by the p90 of the
  step-by-step ratio.

Quick mode: 6 steps (2 warm-up); the full run: 20 steps (4 warm-up). Gloo on a shared CPU says
nothing about NCCL's speed; the step-time rows compare the two compositions' host work and
communication under the same conditions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from plait.kernels.bench import BenchRow, TimingStats, timing_row
from plait.kernels.testing import run_distributed
from plait.zero_sharding.benchmarks import parallel_3d_model as m
from plait.zero_sharding.benchmarks.parallel_3d_worker import CONTENDERS, run_layout

SHAPE = dict(vocab=128, hidden=64, heads=4, layers=4, seq=16)
BASE = dict(shape=SHAPE, rows=8, micro_rows=2, adamw=dict(lr=3e-3, weight_decay=0.01))
QUICK = dict(BASE, steps=6, warmup=2, count_step=3)
FULL = dict(BASE, steps=20, warmup=4, count_step=5)
LAYOUTS = {"W=4 dp2 x tp2": dict(dp=2, tp=2), "W=4 dp2 x pp2": dict(dp=2, pp=2),
           "W=8 dp2 x pp2 x tp2": dict(dp=2, pp=2, tp=2)}
LOSS_RTOL, TIME_RATIO = 1e-5, 1.0  # the targets


def reference_losses(spec: dict[str, Any]) -> list[float]:
    """One process, the whole decoder, the whole global batch: the mean cross-entropy per step."""
    from plait.zero_sharding.benchmarks.parallel_3d_worker import data

    torch.set_num_threads(1)
    model = m.build_stage(m.DecoderShape(**spec["shape"]))
    optimizer = torch.optim.AdamW(model.parameters(), **spec["adamw"])
    out = []
    for step in range(spec["steps"]):
        ids, target = data(spec, step, 0, spec["rows"])
        loss = F.cross_entropy(model(ids).reshape(-1, spec["shape"]["vocab"]), target.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(float(loss.detach()))
    return out


def _layout_session(layouts: dict[str, dict[str, int]], spec: dict[str, Any]) -> dict[str, Any]:
    """Every rank: the layouts of one world size, one after the other."""
    return {label: run_layout(dims, spec) for label, dims in layouts.items()}


def loss_rows(label: str, per_rank: list[dict], reference: list[float]) -> list[BenchRow]:
    """Largest relative loss difference from one process, per contender (the last rank is in the last stage)."""
    ref = torch.tensor(reference, dtype=torch.float64)
    rows = []
    for name in CONTENDERS:
        ours = torch.tensor(per_rank[-1]["losses"][name], dtype=torch.float64)
        worst = float(((ours - ref).abs() / ref.abs()).max())
        rows.append(BenchRow(benchmark=f"{label}: {name} losses vs one process", figure="max relative diff",
                             ours=worst, target=f"<= {LOSS_RTOL:g}", passed=worst <= LOSS_RTOL,
                             note=f"{len(reference)} AdamW steps; final loss {float(ours[-1]):.4f} "
                                  f"(one process {reference[-1]:.4f})"))
    return rows


def exact_rows(label: str, per_rank: list[dict]) -> list[BenchRow]:
    """Measured bytes against the formula, rank 0's shown; passes when every rank's are exact."""
    rows = []
    figures = {"state": "model-state bytes/rank", "dp": "dp bytes/step", "tp": "tp bytes/step",
               "pp": "pp bytes sent/step"}
    for key, figure in figures.items():
        measured = [r["counted"][key] for r in per_rank]
        formula = [r["formula"][key] for r in per_rank]
        if key in ("tp", "pp") and not any(formula) and not any(measured):
            continue  # the layout has no such dimension
        exact = measured == formula
        rows.append(BenchRow(benchmark=f"{label}: plait ZeRO-2, rank 0", figure=figure, ours=measured[0],
                             peer="3-D formula", peer_value=formula[0],
                             ratio=measured[0] / formula[0] if formula[0] else None, target="= formula",
                             passed=exact, note=f"ranks {'all exact' if exact else f'{measured} vs {formula}'}"
                                                f"; other plait bytes {max(r['counted']['other'] for r in per_rank)}"
                             if key == "dp" else f"ranks {'all exact' if exact else f'{measured} vs {formula}'}"))
    return rows


def time_row(label: str, per_rank: list[dict]) -> BenchRow:
    """Step time, plait vs FSDP2, from rank 0's clock."""
    times = per_rank[0]["times"]
    return timing_row(f"{label}: step, plait ZeRO-2 vs FSDP2 on the same mesh",
                      TimingStats.of(times[CONTENDERS[0]]), CONTENDERS[1], TimingStats.of(times[CONTENDERS[1]]),
                      target_ratio=TIME_RATIO)


def run(quick: bool) -> list[BenchRow]:
    """Run the benchmark (see the module docstring).

    Args:
        quick: 6 steps instead of 20.

    Returns:
        The table's rows.
    """
    spec = QUICK if quick else FULL
    reference = reference_losses(spec)
    results: dict[str, list[dict]] = {}
    for world in (4, 8):
        layouts = {label: dims for label, dims in LAYOUTS.items() if label.startswith(f"W={world} ")}
        per_rank = run_distributed(_layout_session, world, layouts, spec, timeout=3000)
        for label in layouts:
            results[label] = [rank[label] for rank in per_rank]
    rows = []
    for label, per_rank in results.items():
        rows += loss_rows(label, per_rank, reference)
        rows += exact_rows(label, per_rank)
        rows.append(time_row(label, per_rank))
    return rows
