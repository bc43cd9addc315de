"""Pieces of ``plait bench deepspeed-shim`` (plait.zero_sharding.benchmarks.shim_*): the job's validation,
the example configs as the shim's translator reads them, and the rows' targets (the step-time row passes by
the p90 of the paired ratio, the loss row by the worst relative difference). The run itself needs
DeepSpeed, whose start-up alone takes tens of seconds: it is left to the suite; the shim tests hold the
same script's losses against DeepSpeed's."""

from __future__ import annotations

import pytest

from plait.kernels.bench import TimingStats
from plait.zero_sharding.benchmarks import shim_suite
from plait.zero_sharding.benchmarks.shim_worker import ZERO_BLOCKS, ShimJob, ds_config
from plait.zero_sharding.deepspeed.config import translate


@pytest.mark.parametrize("bad", [dict(model="gpt"), dict(model="mlp-50m"), dict(configs=()),
                                 dict(configs=("ZeRO-4",)), dict(steps=0), dict(batch=1)])
def test_job_refuses_bad_fields(bad: dict) -> None:
    with pytest.raises(ValueError, match="ShimJob"):
        ShimJob(**bad)


def test_unknown_config_is_named() -> None:
    with pytest.raises(ValueError, match="ZeRO-4"):
        ds_config("ZeRO-4", 4)


@pytest.mark.parametrize("name", list(ZERO_BLOCKS))
def test_example_configs_translate(name: str) -> None:
    if "offload" in name:
        import plait.offload_io  # noqa: F401 - registers the offload keys
    plan = translate(ds_config(name, 4), world_size=2)
    assert plan.zero.stage == int(name[5]) and plan.zero.max_grad_norm == 1.0
    assert plan.micro_batch_size == 4 and plan.optimizer.name == "AdamW"
    assert ("offload" in plan.extensions) == ("offload" in name)


def _stats(*samples: float) -> TimingStats:
    return TimingStats.of(list(samples))


def _result(ours: list[float], theirs: list[float], plait_losses: list[float]) -> dict:
    return {"wall": {"plait": _stats(*ours), "DeepSpeed": _stats(*theirs)},
            "cpu": {"plait": _stats(*ours), "DeepSpeed": _stats(*theirs)},
            "losses": {"plait": plait_losses, "DeepSpeed": [2.0, 1.5, 1.0]}}


def test_rows_pass_by_the_ratio_p90_and_the_worst_loss() -> None:
    fast = _result([0.5] * 9 + [0.7], [1.0] * 10, [2.0, 1.5, 1.0 + 5e-6])
    wall, cpu, loss = shim_suite.config_rows("t", [fast, fast])
    assert wall.passed is True and "ratio p10/median/p90" in wall.note
    assert cpu.passed is None and loss.passed is True and loss.ours == pytest.approx(5e-6)
    # median ratio 0.5 but p90 0.9: fails, as a figure that holds only on some steps does not hold
    noisy = _result([0.5] * 8 + [0.9, 0.9], [1.0] * 10, [2.0, 1.5, 1.0 + 2e-5])
    wall, _, loss = shim_suite.config_rows("t", [noisy, fast])
    assert wall.passed is False and loss.passed is False
    short = _result([0.5] * 10, [1.0] * 10, [2.0, 1.5])
    assert shim_suite.loss_row("t", [short]).passed is False
