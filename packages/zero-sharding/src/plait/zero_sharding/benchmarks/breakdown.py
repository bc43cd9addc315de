"""``plait bench zero-breakdown``: where a step's time goes, plait ZeRO-2/3 beside FSDP2 and DDP.

``run(quick)`` follows the ``plait.benchmarks`` convention: one ``run_distributed`` call at world
size 2 (gloo, one thread per rank) runs :func:`~.breakdown_worker.run_breakdown` on the 27.4M
tiny-llama (the Lightning benchmark's shape; ``--quick``: the 2-layer, vocab-1024 stand-in with
fewer rounds), and rank 0's figures become rows, one figure per contender:

* clocks over alternated (ABBA) steps: wall median with p10/p90, the wall ratio to DDP taken
  round by round (its p10/median/p90), the training thread's CPU time, the time it was blocked
  (``wall - thread CPU``: communication wait plus time off the CPU under load), and the gloo
  threads' CPU time;
* communication: its wall when run alone (same kinds and bytes), the part the profile shows the
  thread waiting on (``comm_calls``), and the hidden rest;
* the profiled split of the main thread (compute, copies, optimizer, framework hooks, other) and
  counts that load cannot move: allocations, copy calls and elements copied per step;
* the floor: compute + optimizer, the work every engine does whatever its overhead.

:func:`render_markdown` turns a results file into the README's table (a test keeps the README
equal to it) and :func:`write_png` draws the stacked bars beside the results file.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from plait.kernels.bench import BenchRow, TimingStats, ratio_stats
from plait.kernels.testing import run_distributed
from plait.zero_sharding.benchmarks.breakdown_worker import CATEGORIES, BreakdownJob, run_breakdown
from plait.zero_sharding.benchmarks.stacked_png import stacked_bars_png

SUITE = "zero-breakdown"
FULL = BreakdownJob(model="tiny-llama-27m", batch=4, seq=128, warmup=2, rounds=5, profiled=2)
QUICK = BreakdownJob(model="tiny-llama-2l", batch=4, seq=32, warmup=1, rounds=3, profiled=2)
BASELINE = "DDP"
# The stacked segments, bottom-up (PNG colours in this order: blue, orange, green, red, purple, brown).
SEGMENTS = ("compute", "optimizer", "copies", "hooks", "comm_calls", "other")
LABELS = {"compute": "compute (fwd+bwd ops)", "optimizer": "optimizer update", "copies": "copies + allocations",
          "hooks": "framework hooks (Python)", "comm_calls": "communication waited on", "other": "other Python"}


def run(quick: bool) -> list[BenchRow]:
    """Run the breakdown (see the module docstring) and write its PNG where ``plait bench`` writes
    the run's JSON.

    Args:
        quick: the 2-layer stand-in and fewer rounds (about half a minute).

    Returns:
        The rows, the PNG's row last.
    """
    job = QUICK if quick else FULL
    per_rank = run_distributed(run_breakdown, 2, job, timeout=600 if quick else 1800)
    rows = rows_from(per_rank[0], job)
    from plait.kernels.cli.bench import plot_path

    png = write_png(rows, plot_path(SUITE, SUITE, quick=quick))
    return rows + [BenchRow(benchmark=_tag(job), figure="plot", ours=float(len(_contenders(rows))),
                            note=f"PNG: {png.name} (beside the results file)")]


def _tag(job: BreakdownJob) -> str:
    return f"{job.model} {job.dtype} W=2 batch {job.batch}x{job.seq}"


def rows_from(result: dict[str, Any], job: BreakdownJob) -> list[BenchRow]:
    """Rows of one rank's :func:`run_breakdown` result (times in ms, counts per step): ``peer`` names
    the contender, ``ours`` is its figure; step-wall rows also carry DDP's median (``peer_value``)
    and the median of the per-round ratio to DDP (``ratio``, p10/median/p90 in the note).

    Returns:
        The rows.
    """
    tag = _tag(job)
    rows: list[BenchRow] = []
    base = result.get(BASELINE)
    for name, figures in result.items():
        if name == "errors":
            rows += [BenchRow(benchmark=tag, figure="step wall (ms)", ours=float("nan"), peer=peer,
                              note=f"could not run here: {error}") for peer, error in figures.items()]
            continue
        wall = TimingStats.of(figures["wall"])
        note = f"p10/p90 {wall.p10 * 1e3:.1f}/{wall.p90 * 1e3:.1f}"
        ratio = ratio_stats(wall, TimingStats.of(base["wall"])) if base is not None and name != BASELINE else None
        if ratio is not None:
            rows.append(BenchRow(benchmark=tag, figure="step wall (ms)", ours=wall.median * 1e3, peer=name,
                                 peer_value=statistics.median(base["wall"]) * 1e3, ratio=ratio.median,
                                 note=f"{note}; ratio to DDP per ABBA step p10/median/p90 "
                                      f"{ratio.p10:.3f}/{ratio.median:.3f}/{ratio.p90:.3f}"))
        else:
            rows.append(BenchRow(benchmark=tag, figure="step wall (ms)", ours=wall.median * 1e3, peer=name, note=note))
        rows += _figure_rows(tag, name, figures)
    return rows


def _figure_rows(tag: str, name: str, figures: dict[str, Any]) -> list[BenchRow]:
    prof = figures["profile"]
    thread = statistics.median(figures["thread_cpu"]) * 1e3
    blocked = statistics.median(w - c for w, c in zip(figures["wall"], figures["thread_cpu"], strict=True)) * 1e3
    comm_wall = figures["comm_wall_s"] * 1e3
    exposed = prof["comm_calls"] / 1e3
    values = {
        "thread CPU (ms)": thread,
        "blocked: wall - thread CPU (ms)": blocked,
        "gloo threads' CPU (ms)": statistics.median(figures["background_cpu"]) * 1e3,
        "communication alone, wall (ms)": comm_wall,
        "communication hidden (ms)": max(0.0, comm_wall - exposed),
        **{f"{LABELS[c]} (ms, profiled)": prof[c] / 1e3 for c in CATEGORIES},
        "profiled step (ms)": prof["total"] / 1e3,
        "floor: compute + optimizer (ms)": (prof["compute"] + prof["optimizer"]) / 1e3,
        "allocations/step": prof["allocations"],
        "copy calls/step": prof["copy_calls"],
        "elements copied/step": prof["copy_elements"],
        "logical bytes/step": float(sum(figures["bytes"].values())),
    }
    return [BenchRow(benchmark=tag, figure=figure, ours=value, peer=name) for figure, value in values.items()]


def _contenders(rows: list[BenchRow]) -> list[str]:
    seen: list[str] = []
    for row in rows:
        if row.figure != "plot" and row.peer and row.peer not in seen and row.ours == row.ours:  # not NaN
            seen.append(row.peer)
    return seen


def write_png(rows: list[BenchRow], path: Path) -> Path:
    """The stacked bars (profiled ms per step, :data:`SEGMENTS` bottom-up), one per contender, in
    the table's column order; grid lines every power of ten that gives 2-20 of them.

    Returns:
        ``path``.
    """
    table = {(row.peer, row.figure): row.ours for row in rows}
    bars = [[table.get((name, f"{LABELS[c]} (ms, profiled)"), 0.0) for c in SEGMENTS] for name in _contenders(rows)]
    top = max((sum(bar) for bar in bars), default=0.0)
    grid = 10 ** math.floor(math.log10(top / 2)) if top > 2 else 1.0  # 2-20 grid lines
    return stacked_bars_png(path, bars, grid=grid)


FLOOR = "CPU floor: thread + gloo threads' CPU (ms)"


def cpu_floor(rows: list[BenchRow], name: str) -> float | None:
    """The step's CPU work on this machine: the training thread's plus gloo's threads' CPU time.
    On 2 cores shared by 2 ranks no engine's step can take less wall time than this (the
    communication work cannot hide behind compute when no core is idle)."""
    table = {(row.peer, row.figure): row.ours for row in rows}
    parts = [table.get((name, figure)) for figure in ("thread CPU (ms)", "gloo threads' CPU (ms)")]
    return None if None in parts else sum(parts)


def _floor_cell(rows: list[BenchRow], name: str) -> str:
    floor, base = cpu_floor(rows, name), cpu_floor(rows, BASELINE)
    if floor is None:
        return "-"
    return f"{floor:.0f}" + (f" ({floor / base:.2f}x DDP)" if base and name != BASELINE else "")


def render_markdown(rows: list[BenchRow], meta: dict[str, Any]) -> str:
    """The README's table: one line per figure, one column per contender, then the run's line.

    Args:
        rows, meta: a results file's content (:func:`plait.kernels.bench.read_json`).

    Returns:
        Markdown text.
    """
    names = _contenders(rows)
    cells: dict[tuple[str, str], str] = {}
    figures: list[str] = []
    tag = next((row.benchmark for row in rows), "")
    for row in rows:
        if row.figure == "plot" or row.peer not in names:
            continue
        if row.figure not in figures:
            figures.append(row.figure)
        text = f"{row.ours:.0f}" if row.ours >= 1000 else f"{row.ours:.1f}"
        if row.ratio is not None:
            text += f" ({row.ratio:.2f}x DDP; p90 {row.note.rsplit('/', 1)[-1]})"
        cells[(row.peer, row.figure)] = text
    lines = [f"| {tag} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {figure} | " + " | ".join(cells.get((n, figure), "-") for n in names) + " |" for figure in figures]
    lines.append(f"| {FLOOR} | " + " | ".join(_floor_cell(rows, n) for n in names) + " |")
    load = meta.get("load_average") or [None, None]
    lines += ["", f"{meta.get('date', '?')}, {meta.get('machine', '?')}, {meta.get('cpus', '?')} CPUs, 1-min load "
                  f"average {load[0]} before / {load[1]} after, `{meta.get('command', 'plait bench ' + SUITE)}`"]
    return "\n".join(lines)


# Figures that load cannot move, and plait's own time, compared across two runs of the suite.
COMPARED = ("thread CPU (ms)", "allocations/step", "copy calls/step", "elements copied/step",
            "framework hooks (Python) (ms, profiled)", "communication waited on (ms, profiled)")


def render_before_after(before: list[BenchRow], after: list[BenchRow], *, label: str) -> str:
    """A markdown table of :data:`COMPARED` for plait's contenders in two results files.

    Args:
        before, after: the two runs' rows (:func:`plait.kernels.bench.read_json`).
        label: what changed between them, for the header.

    Returns:
        Markdown text, one line per figure, a before and an after column per plait contender.
    """
    names = [n for n in _contenders(after) if n.startswith("plait") and n in _contenders(before)]

    def value(rows: list[BenchRow], name: str, figure: str) -> str:
        found = next((row.ours for row in rows if row.peer == name and row.figure == figure), None)
        return "-" if found is None else (f"{found:.0f}" if found >= 1000 else f"{found:.1f}")

    header = " | ".join(f"{name} before | {name} after" for name in names)
    lines = [f"| {label} | {header} |", "|---|" + "---|---|" * len(names)]
    for figure in COMPARED:
        cells = " | ".join(f"{value(before, n, figure)} | {value(after, n, figure)}" for n in names)
        lines.append(f"| {figure} | {cells} |")
    return "\n".join(lines)
