"""DeepSpeed's four lr schedules, rebuilt as torch schedulers, against deepspeed.runtime.lr_schedules."""

import os

import pytest
import torch

from plait.zero_sharding.deepspeed.schedules import SCHEDULES, build_schedule

os.environ.setdefault("DS_ACCELERATOR", "cpu")
lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")

CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 8}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_max_lr": 1e-3, "warmup_num_steps": 5,
                       "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_min_ratio": 0.1, "warmup_num_steps": 6,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 8,
                  "cycle_second_step_size": 12, "decay_lr_rate": 0.5, "decay_step_size": 3, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 6,
                  "cycle_first_stair_count": 3, "cycle_momentum": True}),
]


def _optimizer() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5e-4}], lr=1e-3)


def _groups(optimizer: torch.optim.Optimizer) -> list[float]:
    """Every group's lr and both betas, flat."""
    return [float(v) for g in optimizer.param_groups for v in (g["lr"], *g["betas"])]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_schedule_matches_deepspeed_step_for_step(name: str, params: dict) -> None:
    theirs_opt, ours_opt = _optimizer(), _optimizer()
    theirs = getattr(lr_schedules, name)(theirs_opt, **params)
    ours = build_schedule(ours_opt, {"type": name, "params": params})
    assert _groups(ours_opt) == pytest.approx(_groups(theirs_opt), rel=1e-12, abs=0)
    for step in range(45):
        theirs_opt.step()
        ours_opt.step()
        theirs.step()
        ours.step()
        assert _groups(ours_opt) == pytest.approx(_groups(theirs_opt), rel=1e-12, abs=0), step
        assert ours.last_batch_iteration == theirs.last_batch_iteration
        if step == 20:  # a DeepSpeed scheduler state resumes here at the same lr
            resumed_opt = _optimizer()
            resumed = build_schedule(resumed_opt, {"type": name, "params": params})
            resumed.load_state_dict(theirs.state_dict())
            assert [g["lr"] for g in resumed_opt.param_groups] == pytest.approx(
                [g["lr"] for g in theirs_opt.param_groups], rel=1e-12)


def test_unknown_schedule_and_parameter_are_named() -> None:
    with pytest.raises(ValueError, match=r"scheduler.type='LRRangeTest'"):
        build_schedule(_optimizer(), {"type": "LRRangeTest", "params": {}})
    with pytest.raises(ValueError, match=r"scheduler.params for WarmupLR: .*warmup_max"):
        build_schedule(_optimizer(), {"type": "WarmupLR", "params": {"warmup_max": 1.0}})
    with pytest.raises(ValueError, match=r"warmup_type='cosine'"):
        build_schedule(_optimizer(), {"type": "WarmupLR", "params": {"warmup_type": "cosine"}})
    assert set(SCHEDULES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"}
