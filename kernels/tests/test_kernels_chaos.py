"""The chaos driver's planning and accounting, without launching anything (the campaign itself is
tests/test_reliability_chaos.py)."""

from __future__ import annotations

import random

import pytest

from plait.kernels.testing.chaos import (
    ChaosConfig,
    _costs,
    _fault_text,
    _fell_back,
    _plan_campaign,
    plan_faults,
    resume_point,
    summarize,
)
from plait.kernels.testing.faults import Fault, damage_file, largest_file

ALL = ("kill", "hang", "diskfull", "damaged", "sigterm", "slow")


def _simulate(launches: list[list[Fault]], config: ChaosConfig) -> list[int]:
    """A job's checkpoints step by step (keep_last, damaged ones set aside); the step each fault met."""
    saved: list[int] = []
    met = []
    position = 0
    for launch in launches:
        pending = list(launch)
        step = position
        while pending and step < config.steps:
            fault = pending[0]
            if fault.step == step:  # fires before the step trains
                met.append(step)
                pending.pop(0)
                if fault.kind == "slow":
                    pass
                elif fault.kind == "sigterm":
                    saved = sorted({*saved, step + 1})[-config.keep_last:]
                    position = step + 1
                    break
                else:
                    if fault.kind == "damaged" and saved:
                        saved.pop()
                    position = saved[-1] if saved else 0
                    step = position
                    continue
            if (step + 1) % config.save_every == 0:
                saved = sorted({*saved, step + 1})[-config.keep_last:]
            step += 1
    return met


def test_every_planned_fault_fires_after_the_previous_resume_point() -> None:
    config = ChaosConfig(faults_per_job=5, kinds=ALL, steps=9)
    rng = random.Random(0)
    for _ in range(300):
        launches = plan_faults(config, rng)
        assert all(f.kind != "sigterm" for launch in launches for f in launch[:-1])  # a SIGTERM ends its launch
        faults = [f for launch in launches for f in launch]
        assert all(0 <= f.step < config.steps and f.rank in (0, 1) for f in faults)
        assert _simulate(launches, config) == [f.step for f in faults]


def test_a_damaged_newest_checkpoint_falls_back_one_save() -> None:
    config = ChaosConfig(kinds=ALL, steps=9, save_every=3)
    assert resume_point(Fault(kind="damaged", rank=0, step=7), 0, [], config) == (3, [3])
    assert resume_point(Fault(kind="kill", rank=0, step=7), 0, [], config) == (6, [3, 6])
    assert resume_point(Fault(kind="damaged", rank=0, step=2), 0, [], config) == (0, [])  # nothing saved yet
    # after a SIGTERM at step 4 (saved at 5): the newest at step 7 is 6, the one before it 5
    assert resume_point(Fault(kind="damaged", rank=1, step=7), 5, [3, 5], config) == (5, [5])
    assert resume_point(Fault(kind="sigterm", rank=1, step=4), 3, [3], config) == (5, [3, 5])


def test_damage_flips_one_bit_of_the_largest_file(tmp_path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "manifest.json").write_bytes(b"{}")
    big = tmp_path / "data" / "rank-0.bin"
    big.write_bytes(bytes(range(256)) * 4)
    assert largest_file(tmp_path) == big
    offset = damage_file(big)
    got = big.read_bytes()
    assert offset == 512 and got[offset] == (bytes(range(256)) * 4)[offset] ^ 1
    assert got[:offset] + got[offset + 1:] == (bytes(range(256)) * 4)[:offset] + (bytes(range(256)) * 4)[offset + 1:]
    with pytest.raises(FileNotFoundError, match="no file"):
        largest_file(tmp_path / "data" / "missing")


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
    damaged = Fault(kind="damaged", rank=0, step=7)
    events = [{"event": "start", "attempt": 0, "step": 0, "time": 0.0},
              {"event": "save", "attempt": 0, "step": 3, "time": 3.0},
              {"event": "save", "attempt": 0, "step": 6, "time": 6.0},
              {"event": "fault", "attempt": 0, "step": 7, "time": 7.0, "fault": str(damaged)},
              {"event": "start", "attempt": 1, "step": 0, "time": 9.0},
              {"event": "fallback", "attempt": 1, "step": 0, "time": 10.0, "damaged": "step-0000000006"},
              {"event": "resume", "attempt": 1, "step": 3, "time": 11.0}]
    assert _costs(events, damaged, config) == (4, 8.0)  # steps 3-6 again, from the save at 3
    assert _fell_back(events, damaged) and not _fell_back(events[:5], damaged)
    # drawn again after the fallback: the second firing is costed from its own events
    events += [{"event": "save", "attempt": 1, "step": 6, "time": 12.0},
               {"event": "fault", "attempt": 1, "step": 7, "time": 13.0, "fault": str(damaged)},
               {"event": "start", "attempt": 2, "step": 0, "time": 15.0},
               {"event": "resume", "attempt": 2, "step": 3, "time": 17.0}]
    assert _costs(events, damaged, config, 1) == (4, 14.0) and not _fell_back(events, damaged, 1)


@pytest.mark.parametrize("bad", [dict(kinds=("melt",)), dict(kinds=()), dict(faults=0), dict(steps=3),
                                 dict(keep_last=1, kinds=("damaged",))])
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


@pytest.mark.parametrize("faults", [1, 7, 20, 100])
def test_a_campaign_plans_exactly_its_faults_even_when_a_job_draws_one_fault_twice(faults: int) -> None:
    # One rank and two kinds: the same fault is often drawn twice in a job, also where the last job is cut.
    for seed in range(50):
        config = ChaosConfig(seed=seed, faults=faults, faults_per_job=5, kinds=("damaged", "kill"), world_size=1)
        jobs = _plan_campaign(config, ["a", "b"])
        assert sum(len(planned) for _, launches in jobs for planned in launches) == faults


def test_a_fault_followed_by_a_fresh_start_is_costed_from_that_start() -> None:
    config = ChaosConfig(kinds=ALL, steps=9, save_every=3)
    first = Fault(kind="damaged", rank=0, step=0)  # nothing saved yet: the restart starts from 0
    second = Fault(kind="damaged", rank=0, step=4)
    events = [{"event": "start", "attempt": 0, "step": 0, "time": 0.0},
              {"event": "fault", "attempt": 0, "step": 0, "time": 1.0, "fault": str(first)},
              {"event": "start", "attempt": 1, "step": 0, "time": 5.0},
              {"event": "save", "attempt": 1, "step": 3, "time": 8.0},
              {"event": "fault", "attempt": 1, "step": 4, "time": 9.0, "fault": str(second)},
              {"event": "start", "attempt": 2, "step": 0, "time": 12.0},
              {"event": "fallback", "attempt": 2, "step": 0, "time": 13.0, "damaged": "step-0000000003"},
              {"event": "done", "attempt": 2, "step": 9, "time": 20.0}]
    assert _costs(events, first, config) == (0, 5.0) and not _fell_back(events, first)
    assert _costs(events, second, config) == (4, 12.0) and _fell_back(events, second)
