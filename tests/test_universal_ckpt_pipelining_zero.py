"""Cross-package: a torch.distributed.pipelining PP=2 checkpoint (plait-universal-ckpt's
``model_parallel`` per stage) loads into plait-zero-sharding ZeRO-3 at W=3: every tensor bitwise
after the load, and the next steps follow the pipeline run continuing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed

# The pipeline fixtures of plait-universal-ckpt's own tests (imported in each rank too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "universal-ckpt" / "tests"))
import pipelining_models as pm
from test_universal_ckpt_pipelining import save_pp2

pytest.importorskip("torch.distributed.pipelining")
pytest.importorskip("plait.zero_sharding")


def resume_zero3(root: str) -> dict:
    """Load into plait ZeRO-3 (every rank the same batch), re-save, train 3 steps of 2 micro-batches."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    model, optimizer = zero_shard(pm.TinyLM(1), torch.optim.AdamW, ZeroConfig(stage=3), **pm.ADAMW)
    with pytest.raises(uc.CheckpointLayoutError, match=r"zero.loss_scaler is not in the checkpoint.*strict=False"):
        uc.load({"model": model}, root)
    uc.load({"model": model}, root, strict=False)  # a pipeline run has no loss scaler: ZeRO keeps its own
    resaved = uc.save({"model": model}, f"{root}-zero3", step=3)
    losses = []
    for ids, target in pm.batches(2, 3):
        for mb_ids, mb_target in zip(ids.chunk(pm.MICROBATCHES), target.chunk(pm.MICROBATCHES)):
            loss = pm.loss_fn(model(mb_ids), mb_target)
            # Halving the loss halves every gradient exactly, as GPipe's division of the sum does.
            (loss / pm.MICROBATCHES).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "resaved": str(resaved.path)}


def test_pipelining_pp2_checkpoint_resumes_under_plait_zero3_w3(tmp_path):
    per_rank = run_distributed(save_pp2, 2, str(tmp_path / "pp"), timeout=150)
    saved = {name: tensor for rank in per_rank for name, tensor in rank["states"].items()}
    results = run_distributed(resume_zero3, 3, str(tmp_path / "pp"), timeout=150)

    resaved_dir = Path(results[0]["resaved"])
    manifest = uc.read_manifest(resaved_dir)
    assert manifest.layout.world_size == 3
    for name, tensor in saved.items():  # what each stage held, now held by ZeRO-3's partitions
        assert torch.equal(uc.read_full(resaved_dir, manifest, manifest.tensors[f"model/{name}"]), tensor), name
    for result in results:
        # Same state, batches and micro-batches; ZeRO-3 averages three identical gradients where the
        # pipeline has one, so the float32 sums round differently and AdamW carries that on.
        torch.testing.assert_close(result["losses"], per_rank[-1]["next"], rtol=1e-5, atol=1e-6)
