"""Preemption for Lightning Fabric: SIGTERM to one rank, every rank saves after the same step, exits 0,
and the relaunched job resumes bit for bit.

``reliability_fabric_job.py`` is a Fabric loop (``PlaitFabricStrategy`` ZeRO-3, ``devices=2``,
Fabric's own launcher) with ``collectives.PreemptionGuard``. SIGTERM goes to rank 1 only (a
launched rank, not the one holding the launcher), before step 4. Checked: both ranks stop after
step 4 and save one checkpoint (``fabric.save``), both exit 0 and nothing is left; the relaunch
(``resume``) starts from step 5 and its losses are bit for bit those of a straight run of the
same model, trained in the same process after the resumed one (the reference).

Two Lightning launches: 19.7 s in a quiet CI run, 104 s at load 15 (177 s at load 38), so it runs in
every CI run, with each launch bounded by ``LIMIT_S``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_jobs import live_processes_mentioning, run_in_session

pytest.importorskip("lightning")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="finds leftover processes through /proc")]

JOB = Path(__file__).with_name("reliability_fabric_job.py")
LIMIT_S = 150


def _launch(outdir: Path, *args: str) -> tuple[int, str, float]:
    run = run_in_session([sys.executable, str(JOB), args[0], str(outdir), *args[1:]], limit_s=LIMIT_S,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}, keep="stderr")
    return run.rc, run.output, run.ended


def test_sigterm_to_a_launched_fabric_rank_saves_exits_zero_and_resumes(tmp_path):
    code, err, ended = _launch(tmp_path, "preempt", "sigterm:rank=1:step=4")
    assert code == 0, err[-3000:]
    assert live_processes_mentioning(str(tmp_path)) == []
    preempt = [json.loads((tmp_path / f"preempt-rank{rank}.json").read_text()) for rank in (0, 1)]
    signalled = preempt[1]["signalled_at"]
    saved = max(p["saved_at"] for p in preempt)
    print(f"fabric preemption: SIGTERM to rank 1 -> saved on both ranks {saved - signalled:.2f} s later; "
          f"rank 0 (the launcher) exited 0 {ended - signalled:.1f} s after SIGTERM; nothing left")
    assert [p["stopped"] for p in preempt] == [4, 4]
    assert preempt[0]["signalled_at"] is None and signalled is not None

    code, err, _ = _launch(tmp_path, "resume")
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        resumed = json.loads((tmp_path / f"resume-rank{rank}.json").read_text())
        straight = {int(step): bits for step, bits in resumed["straight"].items()}
        first = {int(step): bits for step, bits in preempt[rank]["losses"].items()}
        assert resumed["start"] == 5
        assert first == {step: straight[step] for step in range(5)}
        assert {int(step): bits for step, bits in resumed["losses"].items()} == {s: straight[s] for s in range(5, 9)}
