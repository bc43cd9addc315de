"""``plait bench lightning --quick`` runs every strategy (plait_zero2/3, ddp, FSDP2 through
ModelParallelStrategy), measures each, and the four train the same model to the same loss."""

from __future__ import annotations

import math
import re

import pytest

from plait.lightning.benchmarks import suite


@pytest.mark.timeout(300)
def test_quick_suite_measures_every_strategy_on_the_same_curve() -> None:
    rows = suite.run(quick=True)
    steps = [r for r in rows if r.figure == "step time (ms)"]
    memory = [r for r in rows if r.figure.startswith("peak RSS")]
    assert len(steps) == 4 and len(memory) == 4
    for row in rows:
        assert row.ours > 0 and row.peer_value is not None and row.peer_value > 0, row
        assert math.isclose(row.ratio, row.ours / row.peer_value, rel_tol=1e-9)
    for row in steps:  # same seed, data and optimizer: every strategy ends on the same loss
        ours, peer = re.search(r"last loss ours ([\d.]+), peer ([\d.]+)", row.note).groups()
        assert math.isclose(float(ours), float(peer), rel_tol=1e-4), row.note
    assert {r.target for r in steps} == {"<= 1", "", "<= 1.05", "<= 0.8"}
