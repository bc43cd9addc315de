"""Cross-package: HF GPT-2 and BLOOM trained under torch tensor parallelism at TP=2 (the
fused-QKV layouts of plait-universal-ckpt's own tests) load into plait-zero-sharding ZeRO-3 at W=3:
every parameter and AdamW tensor bitwise the TP run's, assembled by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed

# The TP fixtures of plait-universal-ckpt's own tests (imported in each rank too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "universal-ckpt" / "tests"))
import hf_torch_tp as ht
from test_universal_ckpt_hf_torch_tp import MODELS, save_tp2

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.tensor.parallel")
pytest.importorskip("plait.zero_sharding")


def load_zero3(name: str, root: str) -> str:
    """Load into plait ZeRO-3 (a torch TP run has no loss scaler: ZeRO keeps its own), re-save."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    model, _ = zero_shard(MODELS[name][0](1), torch.optim.AdamW, ZeroConfig(stage=3), **ht.ADAMW)
    uc.load({"model": model}, root, strict=False)
    return str(uc.save({"model": model}, f"{root}-zero3", step=3).path)


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_torch_tp2_loads_into_plait_zero3_w3(tmp_path, name):
    saved = run_distributed(save_tp2, 2, name, str(tmp_path / "tp2"), str(tmp_path / "wrong"), timeout=150)[0]
    resaved = Path(run_distributed(load_zero3, 3, name, str(tmp_path / "tp2"), timeout=150)[0])
    manifest = uc.read_manifest(resaved)
    assert manifest.layout.world_size == 3
    for key, tensor in saved["states"].items():
        entry = manifest.tensors[f"model/{key}"]
        assert torch.equal(uc.read_full(resaved, manifest, entry).reshape(tensor.shape), tensor), key
