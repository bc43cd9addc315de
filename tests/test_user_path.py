"""The path a user takes, end to end, on a real HF architecture (a tiny random Llama, built offline).

ZeRO-3 training with CPU offload (plait-zero-sharding + plait-offload-io) at W=2 -> a universal
checkpoint (plait-universal-ckpt) -> resume at W=1 and continue -> HF export -> ``from_pretrained``
-> plait's inference kernels applied (plait-inference-kernels) -> greedy tokens equal the
unpatched model's.
"""

from __future__ import annotations

import math

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed, train_losses

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 4, 16
SAVE_AT = 2
OPT = dict(lr=3e-3, fused=True)  # the offload placement steps AdamW with torch's fused CPU kernel


def _config():
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def _zero3(seed: int, placement=None):
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config())
    return zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, **OPT)


def train_offloaded(root: str) -> list[float]:
    """W=2: ZeRO-3 with parameters, fp32 masters and AdamW state on the CPU; save at SAVE_AT, then
    one more step (the loss a resume must reproduce)."""
    from plait.offload_io import OffloadConfig, zero_placement

    placement = zero_placement(OffloadConfig(device="cpu", param_device="cpu"))
    model, optimizer = _zero3(0, placement)
    losses = train_losses(model, optimizer, SAVE_AT, batch=BATCH, seq=SEQ)
    uc.save({"model": model}, root, step=SAVE_AT)
    losses += train_losses(model, optimizer, 1, batch=BATCH, seq=SEQ, start=SAVE_AT)
    placement.close()
    return losses


def resume_one_process(root: str, out: str) -> list[float]:
    """W=1, no offload, a different seed: everything must come from the checkpoint."""
    model, optimizer = _zero3(7)
    uc.load({"model": model}, root)
    losses = train_losses(model, optimizer, 2, batch=BATCH, seq=SEQ, start=SAVE_AT)
    uc.save({"model": model}, out, step=SAVE_AT + 2)
    return losses


def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              pad_token_id=0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_offloaded_resume_export_serve(tmp_path):
    from plait.inference_kernels.patching import PatchConfig, apply, revert
    from plait.universal_ckpt.interop.hf import export_hf

    first = run_distributed(train_offloaded, 2, str(tmp_path / "train"), timeout=240)
    # Each rank's loss is over its half of the batch (equal token counts): the global loss is their mean.
    global_losses = [(a + b) / 2 for a, b in zip(*first)]
    assert all(math.isfinite(x) for x in global_losses)
    resumed = run_distributed(resume_one_process, 1, str(tmp_path / "train"), str(tmp_path / "resumed"),
                              timeout=180)[0]
    # The resumed step SAVE_AT sees the same weights, moments and data as the W=2 run's: only the
    # order of the cross-rank sums differs.
    assert resumed[0] == pytest.approx(global_losses[SAVE_AT], rel=1e-5)
    assert resumed[1] < global_losses[0]

    hf_dir = export_hf(tmp_path / "resumed", tmp_path / "hf", config=_config())
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    final = uc.latest(tmp_path / "resumed")
    manifest = uc.read_manifest(final)
    saved = {e.name.removeprefix("model."): uc.read_full(final, manifest, e)
             for e in manifest.tensors.values() if e.kind == "parameter"}
    state = model.state_dict()
    assert sorted(saved) == sorted(name for name, _ in model.named_parameters())
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())

    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    unpatched = _greedy(model, prompt)
    # policy="always": on CPU plait's ops run their torch reference and the default keeps the model's
    # own code; the user's path on a GPU patches by default. Here the patched path itself is checked.
    report = apply(model, PatchConfig(policy="always"))
    assert sum(report.patched.values()) > 0, report
    try:
        patched = _greedy(model, prompt)
    finally:
        revert(model)
    assert torch.equal(patched, unpatched)
