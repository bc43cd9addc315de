"""The straggler summary as Lightning metrics: a rank 50 ms late at each step is named in the logs.

``lightning_straggler_job.py`` runs as a user would (``python job.py``, ``devices=2``,
``PlaitStrategy`` ZeRO-3, ``CSVLogger``, ``StragglerMonitor(every_n_steps=4)``); the logged
``plait/slowest_rank`` must be 1 once rank 1 has been late for a few steps, with the others'
waiting on it and the per-rank blocked times logged next to it.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from plait.kernels import collectives
from plait.kernels.testing import run_in_session
from plait.lightning import StragglerMonitor
from plait.lightning.stragglers import summary_metrics

JOB = Path(__file__).with_name("lightning_straggler_job.py")


def test_summary_metrics_and_bad_arguments():
    summary = collectives.WaitSummary(ranks=[0, 1], wait_s=[0.6, 0.01], waited_on_s=[0.0, 0.55], collectives=12)
    assert summary_metrics(summary) == {"plait/slowest_rank": 1.0, "plait/waited_on_s": 0.55,
                                        "plait/wait_s_rank0": 0.6, "plait/wait_s_rank1": 0.01}
    idle = collectives.WaitSummary(ranks=[0, 1], wait_s=[0.0, 0.0], waited_on_s=[0.0, 0.0], collectives=0)
    assert summary_metrics(idle)["plait/slowest_rank"] == -1.0
    with pytest.raises(ValueError, match="every_n_steps"):
        StragglerMonitor(every_n_steps=0)


def test_slow_rank_is_logged_as_a_metric(tmp_path):
    run = run_in_session([sys.executable, str(JOB), str(tmp_path)], limit_s=90,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, keep="stderr")
    assert run.rc == 0, run.output[-3000:]
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("plait/slowest_rank")]
    print("logged:", [(row["step"], row["plait/slowest_rank"], row["plait/waited_on_s"]) for row in rows])
    # computed every 4 steps (Lightning logs at the 0-based step, and repeats the last value between)
    changes = [int(row["step"]) for before, row in zip([None, *rows], rows)
               if before is None or row["plait/waited_on_s"] != before["plait/waited_on_s"]]
    assert changes == [3, 7, 11, 15]
    last = rows[-1]
    assert float(last["plait/slowest_rank"]) == 1.0
    assert float(last["plait/waited_on_s"]) > 0.3  # 14 late steps x 50 ms, some of it in the history
    assert float(last["plait/wait_s_rank0"]) > float(last["plait/wait_s_rank1"])
