"""Cross-package: a DeepSpeed tensor-parallel run (AutoTP=2 + ZeRO-1 at W=2), converted
by plait-universal-ckpt, resumes under plait-zero-sharding ZeRO-3 at W=3 and follows DeepSpeed
continuing in its own layout for 20 steps; a DeepSpeed PipelineModule run (2 stages) loads into
ZeRO-3 at W=3 with every tensor bitwise.

The DeepSpeed fixture is plait-universal-ckpt's own (``make_autotp``, trained here on CPU/gloo by
deepspeed 0.19.8); plait ZeRO-3 needs no deepspeed.
"""

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
import test_universal_ckpt_deepspeed_mp as ds_mp

pytest.importorskip("transformers")
pytest.importorskip("plait.zero_sharding")


def resume_zero3(root: str) -> dict:
    """Load the converted checkpoint into plait ZeRO-3 (every rank the same batch) and train 20 steps."""
    from transformers import LlamaForCausalLM

    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(5)  # other initial weights: everything must come from the checkpoint
    model, optimizer = zero_shard(LlamaForCausalLM(ds_mp._llama_config()), torch.optim.AdamW,
                                  ZeroConfig(stage=3), **ds_mp.ADAMW)
    uc.load({"model": model}, root)
    resaved = uc.save({"model": model}, f"{root}-zero3", step=2)  # the state as ZeRO-3 holds it
    model.train()
    losses = []
    for ids in ds_mp._batches(2, ds_mp.RESUMED_STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "resaved": str(resaved.path)}


def test_autotp_checkpoint_resumes_under_plait_zero3_w3(tmp_path):
    pytest.importorskip("deepspeed")
    src = tmp_path / "ds"
    per_rank = run_distributed(ds_mp.make_autotp, 2, str(src), 1, False, ds_mp.VOCAB, False, ds_mp.RESUMED_STEPS,
                               timeout=150, env={"DS_ACCELERATOR": "cpu"})
    expected = per_rank[0]["losses"]
    ckpt = import_deepspeed(src, tmp_path / "uc")
    results = run_distributed(resume_zero3, 3, str(tmp_path / "uc"), timeout=180)

    # What ZeRO-3 holds after the load, re-saved at W=3: every tensor of the import, bitwise.
    imported = uc.read_manifest(ckpt)
    resaved_dir = Path(results[0]["resaved"])
    resaved = uc.read_manifest(resaved_dir)
    assert resaved.layout.world_size == 3
    compared = 0
    for name, entry in imported.tensors.items():
        if entry.kind in ("parameter", "optimizer_state"):
            assert torch.equal(uc.read_full(ckpt, imported, entry),
                               uc.read_full(resaved_dir, resaved, resaved.tensors[name])), name
            compared += 1
    assert compared == 4 * 21  # masters, exp_avg, exp_avg_sq and step of the 21 Llama parameters

    for result in results:
        # Same state, same batches: DeepSpeed sums the two row-parallel halves and plait averages
        # three identical data-parallel gradients, each in its own float32 order, and AdamW carries
        # that rounding on (the tolerance of the torch TP resume, LOSS_TOLERANCE).
        torch.testing.assert_close(result["losses"], expected, **ds_mp.LOSS_TOLERANCE)


def load_pipeline_zero3(root: str) -> str:
    """Load the converted PipelineModule run into plait ZeRO-3 over the same layers; re-save."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    model, _ = zero_shard(torch.nn.Sequential(*ds_mp._layers()), torch.optim.AdamW, ZeroConfig(stage=3), lr=1e-2)
    uc.load({"model": model}, root)
    return str(uc.save({"model": model}, f"{root}-zero3", step=2).path)


def test_pipeline_module_checkpoint_loads_into_plait_zero3_w3(tmp_path):
    pytest.importorskip("deepspeed")
    trained = run_distributed(ds_mp.make_pipeline, 2, str(tmp_path / "ds"), 2, timeout=150,
                              env={"DS_ACCELERATOR": "cpu"})
    ckpt = import_deepspeed(tmp_path / "ds" / "plain", tmp_path / "uc")
    resaved = Path(run_distributed(load_pipeline_zero3, 3, str(tmp_path / "uc"), timeout=150)[0])
    imported, manifest = uc.read_manifest(ckpt), uc.read_manifest(resaved)
    compared = 0
    for name, entry in imported.tensors.items():
        if entry.kind in ("parameter", "optimizer_state"):
            assert torch.equal(uc.read_full(ckpt, imported, entry),
                               uc.read_full(resaved, manifest, manifest.tensors[name])), name
            compared += 1
    assert compared == 4 * 14  # 7 Linear layers: weights and biases with masters, two moments and a step
    for name, tensor in (item for stage in trained for item in stage.items()):  # what each stage trained
        assert torch.equal(uc.read_full(resaved, manifest, manifest.tensors[f"model/model.{name}"]), tensor), name
