"""CI's per-stage CPU figure (ci/cpu_busy.py): cores busy on average between marks, read from
/proc/stat's counters of the whole machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ci"))
import cpu_busy

sys.path.pop(0)


def _stat(path: Path, user: int, idle: int, iowait: int = 0) -> Path:
    """A /proc/stat of two cores: ``user`` and ``idle`` ticks summed over both."""
    path.write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\n"
                    f"cpu0 {user // 2} 0 0 {idle // 2} 0 0 0 0 0 0\ncpu1 {user // 2} 0 0 {idle // 2} 0 0 0 0 0 0\n"
                    "intr 1 2 3\nctxt 5\n")
    return path


def test_busy_cores_counts_idle_and_iowait_as_free(tmp_path: Path) -> None:
    start = cpu_busy.snapshot(_stat(tmp_path / "a", user=1000, idle=1000))
    # 300 ticks pass: 150 computing, 100 idle, 50 waiting on the disk -> half the two cores busy.
    end = cpu_busy.snapshot(_stat(tmp_path / "b", user=1150, idle=1100, iowait=50))
    assert start.cores == end.cores == 2
    assert cpu_busy.busy_cores(start, end) == pytest.approx(1.0)
    assert cpu_busy.busy_cores(end, end) is None  # no tick passed: no figure rather than 0/0
    assert cpu_busy.snapshot(tmp_path / "missing") is None  # not Linux: the figures are left out
    assert cpu_busy.busy_cores(None, end) is None


def test_report_gives_each_stage_the_interval_to_the_next_mark(tmp_path: Path) -> None:
    marks = tmp_path / "marks.jsonl"
    rows = [{"name": "install alone", "wall": 10.0, "busy": 0, "total": 0, "cores": 2},
            {"name": "end", "wall": 130.0, "busy": 700, "total": 1000, "cores": 2},
            {"name": "two lanes", "wall": 40.0, "busy": 100, "total": 400, "cores": 2}]  # appended late
    marks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = cpu_busy.report(marks)
    assert lines[1].split() == ["seconds", "busy", "stage"]
    assert lines[2].split() == ["30", "0.50", "install", "alone"]  # 100 of 400 ticks on 2 cores
    assert lines[3].split() == ["90", "2.00", "two", "lanes"]  # 600 of 600: both cores busy
    assert cpu_busy.report(tmp_path / "none.jsonl") == ["cores busy per stage: fewer than two marks in none.jsonl"]


def test_marks_of_this_machine_give_a_figure_between_zero_and_its_cores(tmp_path: Path) -> None:
    if cpu_busy.snapshot() is None:
        pytest.skip("no /proc/stat")
    marks = tmp_path / "marks.jsonl"
    cpu_busy.mark("work", marks)
    sum(i * i for i in range(300_000))
    cpu_busy.mark("end", marks)
    seconds, busy, name = cpu_busy.report(marks)[2].split()
    assert name == "work" and 0.0 <= float(busy) <= cpu_busy.snapshot().cores
