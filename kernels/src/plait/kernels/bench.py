"""The shared benchmark vocabulary: result rows, interleaved timing, the table and the JSON.

A package registers a benchmark suite under the ``plait.benchmarks`` entry-point group as
``NAME = "module:run"``; ``run(quick: bool) -> list[BenchRow]``. ``plait bench NAME`` calls it,
prints the rows as the table of shared/benchmarks.md and writes them as JSON. Timings follow
the project's rule: ours and the peer alternate in one run (A B B A), warm-up first, median
with p10/p90, a ratio inside the A-vs-A spread is reported as noise, and a timing target holds
only by the p90 of the round-by-round ratio.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchRow:
    """One line of a benchmark table.

    Attributes:
        benchmark: what was run, e.g. ``"rms_norm fwd 4096x4096 fp32"``.
        figure: what was measured, e.g. ``"time (ms)"`` or ``"bytes/rank"``.
        ours: plait's value.
        peer: the name of the peer, e.g. ``"torch.compile"``; ``""`` when there is none.
        peer_value: the peer's value in the same run (``None`` without a peer).
        ratio: ours / peer for lower-is-better figures, as the benchmark defines it.
        target: the bar as text, e.g. ``"<= 1.0"``.
        passed: whether the target is met; ``None`` when there is no target.
        note: anything the reader needs (noise, skipped peers, why a target is missed).
    """

    benchmark: str
    figure: str
    ours: float
    peer: str = ""
    peer_value: float | None = None
    ratio: float | None = None
    target: str = ""
    passed: bool | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class TimingStats:
    """Median and p10/p90 of a list of seconds."""

    median: float
    p10: float
    p90: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> TimingStats:
        """Summarise ``samples`` (seconds)."""
        ordered = sorted(samples)
        return cls(
            median=statistics.median(ordered),
            p10=_quantile(ordered, 0.1),
            p90=_quantile(ordered, 0.9),
            samples=tuple(samples),
        )

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the run's own noise, used to call small differences noise."""
        return (self.p90 - self.p10) / self.median if self.median else 0.0


def _quantile(ordered: Sequence[float], q: float) -> float:
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread inside the block (shared/benchmarks.md's CPU timing rule), restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rss_bytes() -> tuple[int, int]:
    """(current resident set, peak resident set) of this process in bytes, from ``/proc`` (Linux)."""
    text = Path("/proc/self/status").read_text()

    def field(name: str) -> int:
        line = next((x for x in text.splitlines() if x.startswith(name + ":")), None)
        return int(line.split()[1]) * 1024 if line else 0

    return field("VmRSS"), field("VmHWM")


def reset_peak_rss() -> int:
    """Reset this process's peak resident set to its current one (``/proc/self/clear_refs``) and
    return that level in bytes: ``rss_bytes()[1] - reset_peak_rss()`` afterwards is how far the
    peak rose in between, whatever ran before."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_bytes()[0]


def interleaved_timing(
    candidates: dict[str, Callable[[], object]],
    *,
    warmup: int = 3,
    steps: int = 10,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, TimingStats]:
    """Time several callables alternately in one run, in ABBA order (A B, then B A, ...), so a
    drift in the machine's load falls on every candidate alike; sample ``i`` of every candidate
    comes from the same round, which :func:`ratio_stats` pairs up.

    Args:
        candidates: name -> zero-argument callable doing one step.
        warmup: untimed rounds first.
        steps: timed rounds (the project's minimum is 10).
        sync: called before reading the clock (e.g. ``torch.cuda.synchronize``).
        clock: seconds now; ``time.thread_time`` reads the calling thread's CPU time, which other
            jobs on a shared machine disturb far less than the default wall clock.

    Returns:
        name -> :class:`TimingStats` in seconds.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0.")
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(steps):
        for name in names if round_ % 2 == 0 else names[::-1]:
            fn = candidates[name]
            start = clock()
            fn()
            sync()
            times[name].append(clock() - start)
    return {name: TimingStats.of(samples) for name, samples in times.items()}


def ratio_stats(ours: TimingStats, peer: TimingStats) -> TimingStats | None:
    """p10/median/p90 of the ratio ``ours / peer`` taken sample by sample, i.e. round by round of
    an alternated run (:func:`interleaved_timing`), where both saw the same load.

    Returns:
        The ratios' statistics, or ``None`` when the two do not have the same number of samples
        (not from one alternated run) or a peer sample is zero.
    """
    if not ours.samples or len(ours.samples) != len(peer.samples) or min(peer.samples) <= 0:
        return None
    return TimingStats.of([a / b for a, b in zip(ours.samples, peer.samples, strict=True)])


def timing_row(
    benchmark: str,
    ours: TimingStats,
    peer_name: str,
    peer: TimingStats | None,
    *,
    target_ratio: float | None = None,
    unit_scale: float = 1e3,
    figure: str = "time (ms)",
) -> BenchRow:
    """Build a row comparing two timings; a ratio inside the noise is called noise.

    The ratio shown is the medians' ratio. When the two timings come from one alternated run
    (same number of samples), the row passes only if the p90 of the round-by-round ratio
    (:func:`ratio_stats`) meets the target, so a figure holds at the load it was measured at,
    and the note gives that ratio's p10/median/p90; otherwise the medians' ratio decides.

    Args:
        benchmark: the row's name.
        ours, peer: the two timings (``peer`` may be ``None`` when the peer is unavailable).
        peer_name: the peer's name.
        target_ratio: pass when ours/peer <= this (its p90, see above).
        unit_scale: seconds -> displayed unit (default milliseconds).
        figure: the figure's label.
    """
    if peer is None:
        return BenchRow(benchmark=benchmark, figure=figure, ours=ours.median * unit_scale,
                        peer=peer_name, note="peer unavailable in this environment")
    ratio = ours.median / peer.median
    noise = max(ours.spread, peer.spread)
    note = f"p10/p90 ours {ours.p10 * unit_scale:.3g}/{ours.p90 * unit_scale:.3g}"
    if abs(ratio - 1.0) < noise:
        note += "; difference within noise"
    paired = ratio_stats(ours, peer)
    if paired is not None:
        note += f"; ratio p10/median/p90 {paired.p10:.3g}/{paired.median:.3g}/{paired.p90:.3g}"
    decisive = paired.p90 if paired is not None else ratio
    passed = None if target_ratio is None else decisive <= target_ratio
    return BenchRow(benchmark=benchmark, figure=figure, ours=ours.median * unit_scale,
                    peer=peer_name, peer_value=peer.median * unit_scale, ratio=ratio,
                    target="" if target_ratio is None else f"<= {target_ratio:g}",
                    passed=passed, note=note)


_HEADER = ("benchmark", "figure", "ours", "peer", "peer's", "ratio", "target", "pass", "note")


def _cells(row: BenchRow) -> tuple[str, ...]:
    # A named peer without a value could not run: "n/a" (its reason is in the note), never a number.
    peer_value = "n/a" if row.peer and row.peer_value is None else _num(row.peer_value)
    return (row.benchmark, row.figure, _num(row.ours), row.peer or "-", peer_value, _num(row.ratio),
            row.target or "-", {True: "PASS", False: "FAIL", None: "-"}[row.passed], row.note)


def format_table(rows: Iterable[BenchRow]) -> str:
    """Render rows as the table of docs/benchmarks.md (plain text, aligned columns)."""
    lines = [_HEADER, *(_cells(row) for row in rows)]
    header = _HEADER
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(out)


def format_markdown(rows: Iterable[BenchRow]) -> str:
    """Render rows as the markdown table a README carries (the same columns as :func:`format_table`)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(_HEADER), "|" + "---|" * len(_HEADER), *(line(_cells(row)) for row in rows)])


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.4g}"
    return f"{value:.3e}"


def load_average() -> float | None:
    """The machine's 1-minute load average (other jobs' CPU use: timings on a shared machine need it)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def run_meta(command: str, load_before: float | None, **extra) -> dict:
    """The metadata a results file carries, so its README table says when, where and how it was made.

    Args:
        command: the command line that produced the results (``plait bench NAME``, ``plait train``).
        load_before: :func:`load_average` taken when the run started (the one after is taken now).
        **extra: more fields (the suite name, ``quick``).
    """
    return {**extra, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": platform.platform(), "processor": platform.processor(), "command": command,
            "cpus": os.cpu_count(), "load_average": [load_before, load_average()]}


def write_json(rows: Sequence[BenchRow], path: Path, *, meta: dict | None = None) -> Path:
    """Write rows (and run metadata) as JSON so a README table can be regenerated.

    The file is written to a temporary name and renamed, so an interrupted run never leaves
    a half-written result where the previous one was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta or {}, "rows": [dataclasses.asdict(row) for row in rows]}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_json(path: Path) -> tuple[list[BenchRow], dict]:
    """Read a file :func:`write_json` wrote.

    Returns:
        ``(rows, meta)``.

    Raises:
        ValueError: the file is not a results file (no ``rows`` list).
    """
    payload = json.loads(Path(path).read_text())
    if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list):
        raise ValueError(f"{path} is not a plait bench results file (no 'rows' list); pass a file `plait bench` wrote.")
    names = {field.name for field in dataclasses.fields(BenchRow)}
    rows = [BenchRow(**{k: v for k, v in row.items() if k in names}) for row in payload["rows"]]
    return rows, payload.get("meta") or {}
