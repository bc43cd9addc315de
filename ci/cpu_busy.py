"""How busy the machine's cores were during each stage of a ``ci/test.sh`` run.

Whether two stages can run side by side on CI's two cores depends on how much of each stage is
computing and how much is waiting (on timeouts, restarts, a hung rank's detection, downloads): a
stage that keeps one core busy leaves the other free; one that keeps both busy only slows down
what runs beside it. The figure is read from the kernel's counters of the whole machine
(``/proc/stat``), so it counts every process a stage starts (ranks forked from a forkserver,
torchrun workers, their children), which per-process accounting misses, and it is only meaningful
on a machine that runs nothing but CI.

``ci/test.sh`` marks the start of each stage (``python ci/cpu_busy.py mark NAME``) and prints the
table at the end (``python ci/cpu_busy.py report``): each stage's wall time and its cores busy on
average (``1.0`` = one core fully busy). ``ci/check_install_alone.py`` prints the same figure for
each distribution's tests (:func:`busy_cores`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

MARKS = Path(os.environ.get("PLAIT_CPU_MARKS", Path(__file__).resolve().parent.parent / "build" / "cpu-marks.jsonl"))
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal ... (in clock ticks).
IDLE_FIELDS = (3, 4)  # idle and iowait: a core waiting on the disk is not computing


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The machine's cumulative CPU counters at one moment.

    Attributes:
        wall: ``time.monotonic()`` when read.
        busy: clock ticks all cores spent computing since boot.
        total: clock ticks all cores spent in any state since boot.
        cores: the number of cores the kernel counts.
    """

    wall: float
    busy: int
    total: int
    cores: int


def snapshot(stat: Path = Path("/proc/stat")) -> Snapshot | None:
    """Read the counters now.

    Args:
        stat: the file to read (``/proc/stat``; a test passes its own).

    Returns:
        The snapshot, or ``None`` where the file does not exist (not Linux): the figures are then
        left out and nothing fails.
    """
    if not stat.exists():
        return None
    lines = stat.read_text().splitlines()
    ticks = [int(v) for v in lines[0].split()[1:]]
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    idle = sum(ticks[i] for i in IDLE_FIELDS if i < len(ticks))
    # guest time is already inside user time: the first 8 fields are the whole.
    total = sum(ticks[:8])
    return Snapshot(time.monotonic(), total - idle, total, cores)


def busy_cores(start: Snapshot | None, end: Snapshot | None) -> float | None:
    """Cores busy on average between two snapshots (0 to the number of cores).

    Args:
        start, end: snapshots from :func:`snapshot`, ``start`` first.

    Returns:
        The average, or ``None`` where either snapshot is missing or no tick passed between them.
    """
    if start is None or end is None or end.total <= start.total:
        return None
    return end.cores * (end.busy - start.busy) / (end.total - start.total)


def mark(name: str, marks: Path = MARKS) -> None:
    """Append a snapshot labelled ``name`` (the start of a stage; ``end`` closes the last one).

    Args:
        name: the stage that starts now.
        marks: the file of marks (one JSON object a line).
    """
    now = snapshot()
    if now is None:
        return
    marks.parent.mkdir(parents=True, exist_ok=True)
    with marks.open("a") as out:
        out.write(json.dumps({"name": name, **dataclasses.asdict(now)}) + "\n")


def report(marks: Path = MARKS) -> list[str]:
    """One line per stage: the interval from its mark to the next one.

    Args:
        marks: the file written by :func:`mark`.

    Returns:
        The lines of the table (a single line saying so where there are fewer than two marks).
    """
    rows = [json.loads(line) for line in marks.read_text().splitlines() if line] if marks.exists() else []
    rows.sort(key=lambda row: row["wall"])  # the two lanes append side by side
    if len(rows) < 2:
        return [f"cores busy per stage: fewer than two marks in {marks.name}"]
    lines = [f"cores busy per stage (whole machine, {rows[-1]['cores']} cores)", f"{'seconds':>8}  {'busy':>5}  stage"]
    for first, second in zip(rows, rows[1:]):
        a = Snapshot(first["wall"], first["busy"], first["total"], first["cores"])
        b = Snapshot(second["wall"], second["busy"], second["total"], second["cores"])
        busy = busy_cores(a, b)
        lines.append(f"{b.wall - a.wall:8.0f}  {'-' if busy is None else f'{busy:5.2f}':>5}  {first['name']}")
    return lines


def main(argv: list[str]) -> int:
    """``mark NAME``, ``reset`` (forget the marks of an earlier run) or ``report``."""
    if argv[:1] == ["mark"] and len(argv) == 2:
        mark(argv[1])
    elif argv == ["reset"]:
        MARKS.unlink(missing_ok=True)
    elif argv == ["report"]:
        print("\n".join(report()))
    else:
        print("usage: python ci/cpu_busy.py mark NAME | reset | report", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
