"""A checkpoint written by Lightning's own ``DeepSpeedStrategy`` resumes under plait's strategies.

The oracle is real: Lightning 2.6's ``DeepSpeedStrategy`` with DeepSpeed 0.19.8 trains a module for
2 steps on 2 gloo ranks, saves its checkpoint directory, and continues it for 2 more steps. The
same directory given to ``Trainer.fit(ckpt_path=...)`` with ``plait_zero2`` and ``plait_zero3``
continues with DeepSpeed's losses within 1e-5 (weights, fp32 masters, Adam moments, learning-rate
schedule, step count and loops all came from the DeepSpeed checkpoint).

Lightning's ``DeepSpeedStrategy`` accepts only CUDA devices. To write the oracle checkpoint on this
CPU machine the test lifts its three CUDA-only checks (the accelerator type, the device index
check, and the device index it hands ``deepspeed.initialize``); DeepSpeed then runs on its CPU
accelerator over gloo. Nothing of plait is patched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from plait.kernels.testing import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("plait.lightning")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "lightning" / "tests"))
from test_lightning_distributed import _fit, _quiet

RTOL = 1e-5


def _deepspeed_on_cpu() -> Any:
    """Lightning's DeepSpeedStrategy class with its CUDA-only checks lifted (the oracle only)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
    from lightning.pytorch.strategies.ddp import DDPStrategy

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo transport; no shm op build
    lightning_deepspeed._validate_device_index_selection = lambda devices: None
    if not getattr(deepspeed.initialize, "cpu_device_rank", False):
        real = deepspeed.initialize

        def initialize(*args: Any, **kwargs: Any) -> Any:
            namespace = kwargs.get("args")
            if namespace is not None and getattr(namespace, "device_rank", 0) is None:
                namespace.device_rank = -1  # a CPU device has no index: DeepSpeed's "no device" value
            return real(*args, **kwargs)

        initialize.cpu_device_rank = True
        deepspeed.initialize = initialize

    class CPUDeepSpeedStrategy(lightning_deepspeed.DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # without the CUDA-accelerator check

    return CPUDeepSpeedStrategy


def _session(root: str, stage: int) -> dict[str, Any]:
    _quiet()
    strategy = _deepspeed_on_cpu()
    path = f"{root}/deepspeed-stage{stage}.ckpt"
    first, module = _fit(strategy(stage=stage), devices=2, steps=2, enable_checkpointing=False)
    module.trainer.save_checkpoint(path)
    deepspeed_resumed, _ = _fit(strategy(stage=stage), devices=2, steps=4, ckpt_path=path)
    out = {"first": first, "deepspeed": deepspeed_resumed}
    for name in ("plait_zero2", "plait_zero3"):
        losses, module = _fit(name, devices=2, steps=4, ckpt_path=path)
        out[name] = losses
        out[f"{name}:step"] = module.trainer.global_step
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [3])  # stage 1/2 DeepSpeed checkpoints: tests/test_zero_deepspeed_resume.py
def test_a_lightning_deepspeed_checkpoint_resumes_on_plait(tmp_path: Path, stage: int) -> None:
    out = run_distributed(_session, 2, str(tmp_path), stage, timeout=540)[0]
    theirs = out["deepspeed"]
    assert sorted(out["first"]) == [0, 1] and sorted(theirs) == [2, 3]
    for name in ("plait_zero2", "plait_zero3"):
        ours = out[name]
        assert sorted(ours) == [2, 3], (name, ours)  # the loop resumed at DeepSpeed's step
        for step in (2, 3):
            assert ours[step] == pytest.approx(theirs[step], rel=RTOL), (name, step, ours, theirs)
        assert out[f"{name}:step"] == 4
    # Trained weights, not fresh ones, were continued: step 2's loss is well below step 0's.
    assert theirs[2] < out["first"][0] - 0.1
