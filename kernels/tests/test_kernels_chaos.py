"""The chaos driver's planning and accounting, without launching anything (the campaign itself is
tests/test_reliability_chaos.py)."""

from __future__ import annotations

import random

import pytest

from plait.kernels.testing.chaos import ChaosConfig, _costs, _fault_text, plan_faults, summarize
from plait.kernels.testing.faults import Fault


def test_every_planned_fault_fires_after_the_previous_resume_point() -> None:
    config = ChaosConfig(faults_per_job=5, kinds=("kill", "hang", "diskfull", "sigterm", "slow"), steps=9)
    rng = random.Random(0)
    for _ in range(200):
        position = 0
        for launch in plan_faults(config, rng):
            assert all(f.kind != "sigterm" for f in launch[:-1])  # a SIGTERM ends its launch
            for fault in launch:
                assert position <= fault.step < config.steps and fault.rank in (0, 1)
                if fault.kind in ("sigterm", "slow"):
                    position = fault.step + 1
                else:
                    position = fault.step // config.save_every * config.save_every


def test_restarting_faults_go_to_successive_attempts() -> None:
    faults = [Fault(kind="slow", rank=0, step=1, seconds=0.05), Fault(kind="kill", rank=1, step=2),
              Fault(kind="diskfull", rank=0, step=4, nbytes=99), Fault(kind="sigterm", rank=1, step=7)]
    text, restarts = _fault_text(faults)
    assert restarts == 2
    assert [item.rsplit("@", 1)[1] for item in text.split(",")] == ["0", "0", "1", "2"]
    assert Fault.parse(text.split(",")[2].rsplit("@", 1)[0]) == faults[2]


def test_costs_from_events() -> None:
    config = ChaosConfig(steps=9, save_every=3)
    kill = Fault(kind="kill", rank=1, step=5)
    events = [{"event": "start", "attempt": 0, "step": 0, "time": 0.0},
              {"event": "save", "attempt": 0, "step": 3, "time": 3.0},
              {"event": "fault", "attempt": 0, "step": 5, "time": 5.0, "fault": str(kill)},
              {"event": "start", "attempt": 1, "step": 0, "time": 8.0},
              {"event": "resume", "attempt": 1, "step": 3, "time": 9.5}]
    assert _costs(events, kill, config) == (2, 6.5)
    full = Fault(kind="diskfull", rank=1, step=4, nbytes=10)
    events[2] = {**events[2], "step": 4, "fault": str(full)}
    assert _costs(events, full, config) == (3, 6.5)  # steps 3-5 trained, the save at 6 failed


@pytest.mark.parametrize("bad", [dict(kinds=("melt",)), dict(kinds=()), dict(faults=0), dict(steps=3)])
def test_bad_config_names_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ChaosConfig(**bad)


def test_summarize_median_and_worst() -> None:
    from plait.kernels.testing.chaos import FaultRecord

    rows = [FaultRecord("3", "kill", 0, 4, True, 1, 2.0), FaultRecord("3", "slow", 1, 2, True, 0, 0.5),
            FaultRecord("2", "kill", 1, 5, True, 2, 9.0)]
    summary = summarize(rows)
    assert (summary["faults"], summary["recovered"], summary["steps_lost_median"], summary["steps_lost_worst"]) \
        == (3, 3, 1, 2)
    assert (summary["seconds_lost_median"], summary["seconds_lost_worst"]) == (2.0, 9.0)
