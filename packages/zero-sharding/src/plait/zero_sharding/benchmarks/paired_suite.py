"""The paired suite: plait ZeRO-1/2/3 against DeepSpeed ZeRO-1/2/3, FSDP2 and DDP, plus ZeRO++.

``run(quick)`` follows the ``plait.benchmarks`` convention. Per model and dtype it makes one
timed call at world size 2 (every stage: plait and its peers alternate steps in the same ranks)
and one untimed call at world size 4 (bytes and memory), then turns the figures into rows:

* step time (W=2): plait vs DeepSpeed at each stage (target <= 1.0), vs FSDP2 at stage 3
  (target <= 1.0), vs DDP beside stage 1 (informational);
* logical bytes/step (W=2, 4): plait vs the paper's formula, ``2 Psi b`` (stages 1/2) or
  ``3 Psi b`` (stage 3) with ``b`` the compute dtype's bytes; the target is the exact count the
  engine must hit: the formula over the padded units, plus plait's 32-byte control all-reduce,
  minus (stage 3) one gather of the root unit, which stays gathered from forward to the end of
  backward as FSDP2's root does. Peers' bytes are shown beside (informational);
* model-state bytes/rank (W=2, 4, the largest rank): plait vs the ZeRO formula
  (:func:`plait.zero_sharding.memory.zero_formula_bytes`, target within 2%), vs FSDP2 at stage 3
  (target <= 1.0), vs DeepSpeed and DDP (informational).

Quick mode: tiny-llama with 2 layers and vocab 1024 in fp32, every stage timed at W=2, stage 3
bytes and memory at W=4, and the quick ZeRO++ rows.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from plait.kernels.bench import BenchRow, TimingStats, timing_row
from plait.kernels.testing import run_distributed
from plait.zero_sharding.benchmarks.paired_setup import PairedJob
from plait.zero_sharding.benchmarks.paired_worker import run_paired
from plait.zero_sharding.memory import zero_formula_bytes

ENV = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator (the ranks inherit it)
FULL_COMBOS = (("tiny-llama", "float32"), ("tiny-llama", "bfloat16"), ("mlp-50m", "float32"),
               ("mlp-50m", "bfloat16"))
BATCH = {"tiny-llama": (8, 64), "tiny-llama-2l": (4, 32), "mlp-50m": (16, 2)}  # global (batch, seq)


def _item(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def _with_note(row: BenchRow, extra: str) -> BenchRow:
    fields = {**row.__dict__, "note": "; ".join(part for part in (row.note, extra) if part)}
    return BenchRow(**fields)


def _loss_note(ours: dict[str, Any], peer: dict[str, Any] | None) -> str:
    if not peer or "first_loss" not in ours or "first_loss" not in peer:
        return ""
    return (f"loss first/last ours {ours['first_loss']:.4f}/{ours['loss']:.4f}, "
            f"peer {peer['first_loss']:.4f}/{peer['loss']:.4f}")


def time_rows(tag: str, stage: int, result: dict[str, Any]) -> list[BenchRow]:
    """Step-time rows of one stage of a timed call (rank 0's clock; every step synchronises ranks)."""
    ours_name = f"plait ZeRO-{stage}"
    timings: dict[str, TimingStats] = result["timings"]
    if ours_name not in timings:
        return [BenchRow(benchmark=f"{tag} ZeRO-{stage}", figure="step time (ms)", ours=float("nan"),
                         note=f"plait failed: {result['errors'].get(ours_name, 'unknown')}")]
    peers = [(f"DeepSpeed ZeRO-{stage}", 1.0)] + ([("FSDP2", 1.0)] if stage == 3 else []) \
        + ([("DDP", None)] if stage == 1 else [])
    figures = result["figures"]
    breakdown = figures[ours_name].get("breakdown") or {}
    wait = f"plait comm wait {breakdown['comm_wait_s'] * 1e3:.1f} ms on its last step" if breakdown else ""
    rows = []
    for peer, target in peers:
        row = timing_row(f"{tag} ZeRO-{stage}", timings[ours_name], peer, timings.get(peer),
                         target_ratio=target, figure="step time (ms)")
        if peer in result["errors"]:
            row = BenchRow(benchmark=row.benchmark, figure=row.figure, ours=row.ours, peer=peer,
                           note=f"peer could not run here: {result['errors'][peer]}")
        else:
            row = _with_note(row, _loss_note(figures[ours_name], figures.get(peer)))
        rows.append(_with_note(row, wait))
    return rows


def byte_rows(tag: str, stage: int, dtype: str, result: dict[str, Any]) -> list[BenchRow]:
    """Logical bytes per step: plait against the formula (exact target) and its peers."""
    ours = result["figures"].get(f"plait ZeRO-{stage}")
    if ours is None:
        return []
    expected, item = ours["expected"], _item(dtype)
    factor = 2 if stage < 3 else 3
    paper = factor * expected["psi"] * item
    note = f"exact = {factor}x padded units + 32 B control all-reduce; padding {expected['padding']} el."
    if stage == 3:
        note += f"; root unit ({expected['root']} el.) gathered once"
    rows = [BenchRow(benchmark=f"{tag} ZeRO-{stage}", figure="bytes/step", ours=ours["volume"],
                     peer=f"formula {factor}Psi", peer_value=paper, ratio=ours["volume"] / paper,
                     target=f"= exact {expected['volume']}", passed=ours["volume"] == expected["volume"],
                     note=note)]
    peers = [f"DeepSpeed ZeRO-{stage}"] + (["FSDP2"] if stage == 3 else []) \
        + (["DDP"] if stage == 1 else [])
    for peer in peers:
        figures = result["figures"].get(peer)
        if figures is None:
            error = result["errors"].get(peer, "?")
            rows.append(BenchRow(benchmark=f"{tag} ZeRO-{stage}", figure="bytes/step", ours=ours["volume"],
                                 peer=peer, note=f"peer could not run here: {error}"))
            continue
        ops = ", ".join(f"{op} {nbytes}" for op, nbytes in sorted(figures["by_op"].items()))
        rows.append(BenchRow(benchmark=f"{tag} ZeRO-{stage}", figure="bytes/step", ours=ours["volume"],
                             peer=peer, peer_value=figures["volume"],
                             ratio=ours["volume"] / max(1, figures["volume"]),
                             note=f"peer: {ops} (all-reduce counted twice)"))
    return rows


def memory_rows(tag: str, stage: int, dtype: str, world: int,
                per_rank: list[dict[str, Any]]) -> list[BenchRow]:
    """Model-state bytes on the largest rank: plait against the formula, FSDP2, DeepSpeed, DDP."""
    ours_name = f"plait ZeRO-{stage}"

    def largest(name: str) -> dict[str, Any] | None:
        present = [r["figures"][name] for r in per_rank if name in r["figures"]]
        return max(present, key=lambda f: f["memory"]) if present else None

    ours = largest(ours_name)
    if ours is None:
        return []
    psi = ours["expected"]["psi"]
    formula = zero_formula_bytes(psi, stage=stage, world_size=world, compute_dtype=_dtype(dtype),
                                 grad_dtype=_dtype(dtype), optimizer_state_bytes=8)
    ratio = ours["memory"] / formula
    accounted = ours["model_state"]["total"]
    same = "" if accounted == ours["memory"] else " (differs)"
    note = f"Psi={psi}; model_state_bytes() {accounted}{same}"
    rows = [BenchRow(benchmark=f"{tag} ZeRO-{stage}", figure="model-state bytes/rank", ours=ours["memory"],
                     peer="ZeRO formula", peer_value=formula, ratio=ratio, target="within 2%",
                     passed=abs(ratio - 1) <= 0.02, note=note)]
    peers = [(f"DeepSpeed ZeRO-{stage}", False)] + ([("FSDP2", True)] if stage == 3 else []) \
        + ([("DDP", False)] if stage == 1 else [])
    for peer, targeted in peers:
        figures = largest(peer)
        if figures is None:
            errors = [r["errors"][peer] for r in per_rank if peer in r["errors"]]
            rows.append(BenchRow(benchmark=f"{tag} ZeRO-{stage}", figure="model-state bytes/rank",
                                 ours=ours["memory"], peer=peer,
                                 note=f"peer could not run here: {errors[0] if errors else '?'}"))
            continue
        peer_ratio = ours["memory"] / figures["memory"]
        rows.append(BenchRow(benchmark=f"{tag} ZeRO-{stage}", figure="model-state bytes/rank",
                             ours=ours["memory"], peer=peer, peer_value=figures["memory"], ratio=peer_ratio,
                             target="<= 1" if targeted else "",
                             passed=(peer_ratio <= 1.0) if targeted else None))
    return rows


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def rows_for(model: str, dtype: str, world: int, per_rank: list[dict[int, dict[str, Any]]],
             timed: bool) -> list[BenchRow]:
    """All rows of one ``run_distributed`` call (``per_rank``: each rank's :func:`run_paired` result)."""
    label = "tiny-llama(2 layers, vocab 1024)" if model == "tiny-llama-2l" else model
    tag = f"{label} {'fp32' if dtype == 'float32' else 'bf16'} W={world}"
    rows: list[BenchRow] = []
    for stage in per_rank[0]:
        if timed:
            rows += time_rows(tag, stage, per_rank[0][stage])
        rows += byte_rows(tag, stage, dtype, per_rank[0][stage])
        rows += memory_rows(tag, stage, dtype, world, [r[stage] for r in per_rank])
    return rows


def _cell(row: BenchRow | None, *, value: bool = False) -> str:
    if row is None:
        return "-"
    if row.ratio is None:
        return "n/a" if "could not run" in row.note else "-"
    mark = {True: " ok", False: " MISS", None: ""}[row.passed]
    shown = f"{row.ours:.0f} ms, " if value else ""
    return f"{shown}{row.ratio:.3f}x{mark}"


def markdown_summary(rows: list[BenchRow]) -> str:
    """One line per setup and stage for the README: plait's step time and its ratio to each peer
    (W=2 only), bytes/step and model-state bytes as ratios to the formula and to the peers.
    ``ok``/``MISS`` mark the rows that carry a target; a ratio is ours / theirs.

    Args:
        rows: rows from :func:`run` (ZeRO++ rows are left out: they have their own table).
    """
    cells: dict[tuple[str, str], dict[tuple[str, str], BenchRow]] = {}
    for row in rows:
        if " ZeRO-" not in row.benchmark or row.benchmark.startswith(("ZeRO++", "hpZ")):
            continue
        tag, stage = row.benchmark.rsplit(" ZeRO-", 1)
        cells.setdefault((tag, stage), {})[(row.figure, row.peer.split(" ZeRO-")[0])] = row
    head = ("| setup | stage | step: plait, vs DeepSpeed | vs FSDP2 | vs DDP | bytes/step vs formula "
            "| vs DeepSpeed | vs FSDP2 | memory/rank vs formula | vs FSDP2 | vs DeepSpeed |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (tag, stage), got in cells.items():
        time_ds = got.get(("step time (ms)", "DeepSpeed"))
        bytes_formula = got.get(("bytes/step", f"formula {2 if stage != '3' else 3}Psi"))
        lines.append("| " + " | ".join([
            tag, stage, _cell(time_ds, value=True), _cell(got.get(("step time (ms)", "FSDP2"))),
            _cell(got.get(("step time (ms)", "DDP"))), _cell(bytes_formula),
            _cell(got.get(("bytes/step", "DeepSpeed"))), _cell(got.get(("bytes/step", "FSDP2"))),
            _cell(got.get(("model-state bytes/rank", "ZeRO formula"))),
            _cell(got.get(("model-state bytes/rank", "FSDP2"))),
            _cell(got.get(("model-state bytes/rank", "DeepSpeed"))),
        ]) + " |")
    return "\n".join(lines)


def jobs(quick: bool) -> list[tuple[int, PairedJob]]:
    """(world size, job) pairs the suite runs, in order."""
    if quick:
        batch, seq = BATCH["tiny-llama-2l"]
        return [(2, PairedJob(model="tiny-llama-2l", batch=batch, seq=seq)),
                (4, PairedJob(model="tiny-llama-2l", stages=(3,), timed=False, batch=batch, seq=seq,
                              warmup=1))]
    out = []
    for model, dtype in FULL_COMBOS:
        batch, seq = BATCH[model]
        out.append((2, PairedJob(model=model, dtype=dtype, batch=batch, seq=seq)))
        out.append((4, PairedJob(model=model, dtype=dtype, timed=False, batch=batch, seq=seq, warmup=1)))
    return out


def run(quick: bool) -> list[BenchRow]:
    """Run the paired suite (see the module docstring).

    Args:
        quick: the about-a-minute version (2-layer tiny-llama fp32) instead of the full matrix.

    Returns:
        The table's rows: per model and dtype, time, bytes and memory rows, then ZeRO++ rows.
    """
    rows: list[BenchRow] = []
    planned = jobs(quick)
    for index, (world, job) in enumerate(planned, 1):
        start = time.perf_counter()
        per_rank = run_distributed(run_paired, world, job, timeout=300 if quick else 1200, env=ENV)
        rows += rows_for(job.model, job.dtype, world, per_rank, job.timed)
        kind = "timed" if job.timed else "bytes/memory"
        print(f"[{index}/{len(planned)}] {job.model} {job.dtype} W={world} {kind}: "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    from plait.zero_sharding.zeropp import bench as zeropp_bench

    return rows + zeropp_bench.run(quick)
