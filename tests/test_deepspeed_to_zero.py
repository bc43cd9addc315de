"""A DeepSpeed ZeRO run, imported by plait-universal-ckpt, continues under plait-zero-sharding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.interop.deepspeed import import_deepspeed

# The DeepSpeed run maker of plait-universal-ckpt's own tests (imported in each rank too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "universal-ckpt" / "tests"))
from test_universal_ckpt_deepspeed import make_deepspeed_checkpoints


def continue_under_plait(ckpt: str) -> bool:
    from plait import zero_sharding

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model, optim = zero_sharding.zero_shard(model, torch.optim.AdamW, zero_sharding.ZeroConfig(stage=3), lr=1e-2)
    uc.load({"model": model}, ckpt)
    resaved = uc.save({"model": model}, f"{ckpt}-plait", step=2)
    model(torch.randn(2, 8)).square().mean().backward()
    optim.step()  # training goes on from the imported masters and moments
    return resaved.path.exists()


def test_deepspeed_run_continues_under_plait_zero(tmp_path):
    """A DeepSpeed ZeRO-2 checkpoint, imported, loads into plait.zero_sharding ZeRO-3 at W=2 unchanged."""
    pytest.importorskip("deepspeed")
    run_distributed(make_deepspeed_checkpoints, 2, str(tmp_path), [(2, "fp32")], timeout=240,
                    env={"DS_ACCELERATOR": "cpu"})
    ckpt = import_deepspeed(tmp_path / "ds_2_fp32", tmp_path / "uc")
    assert all(run_distributed(continue_under_plait, 2, str(ckpt), timeout=120))
    imported, manifest = uc.read_manifest(ckpt), uc.read_manifest(uc.latest(f"{ckpt}-plait"))
    for name, entry in manifest.tensors.items():
        if name in imported.tensors:
            assert torch.equal(uc.read_full(ckpt, imported, imported.tensors[name]),
                               uc.read_full(uc.latest(f"{ckpt}-plait"), manifest, entry)), name
