"""Trainer with the offload strategy names: the loss curve equals the in-memory plait ZeRO one exactly.

``plait_zero2_offload`` / ``plait_zero3_offload`` keep fp32 masters and AdamW state on the CPU
through plait-offload-io's ZeRO placement (stage 3 its parameter shards too),
``plait_zero3_offload_nvme`` all of it in files under ``$PLAIT_OFFLOAD_PATH``. The step is
elementwise and runs on CPU tensors in both cases, so the curves must be bitwise equal (not just
close) on 1 and on 2 gloo processes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.kernels.testing import run_distributed

# The Trainer helpers of plait-lightning's own tests (run_distributed imports this module in each
# rank, so the path is set at import).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "lightning" / "tests"))
from test_lightning_distributed import STEPS, _fit, _quiet

PAIRS = {1: (("plait_zero2_offload", "plait_zero2"), ("plait_zero3_offload", "plait_zero3")),
         2: (("plait_zero2_offload", "plait_zero2"), ("plait_zero3_offload", "plait_zero3"),
             ("plait_zero3_offload_nvme", "plait_zero3"))}


def offload_session(devices: int) -> dict[str, Any]:
    """Every strategy of PAIRS[devices] (module level: run_distributed imports it in each rank)."""
    _quiet()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for offloaded, in_memory in PAIRS[devices]:
        for name in (offloaded, in_memory):
            if name not in out:
                losses, module = _fit(name, devices=devices, steps=STEPS)
                placement = module.zero_optimizer.engine.placement
                out[name] = losses
                out[f"{name}:placement"] = (type(placement).__name__, getattr(placement, "config", None))
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("devices", [1, 2])
def test_offload_strategies_match_in_memory_curves(devices: int, tmp_path: Any) -> None:
    results = run_distributed(offload_session, devices, devices, timeout=300,
                              env={"PLAIT_OFFLOAD_PATH": str(tmp_path)})
    for rank, result in enumerate(results):
        for offloaded, in_memory in PAIRS[devices]:
            assert sorted(result[offloaded]) == list(range(STEPS)), (rank, offloaded, result[offloaded])
            assert result[offloaded] == result[in_memory], (rank, offloaded, result[offloaded], result[in_memory])
            kind, config = result[f"{offloaded}:placement"]
            assert kind == "ZeroOffloadPlacement" and config.device == ("nvme" if "nvme" in offloaded else "cpu")
            # Stage 3 offloads the parameter shards to the same device (DeepSpeed's stage_3_offload).
            assert config.param_device == ("none" if "zero2" in offloaded else config.device), (offloaded, config)
            if config.device == "nvme":
                assert config.path == str(tmp_path)
            assert result[f"{in_memory}:placement"][0] == "LocalPlacement"
