"""Training to serving through vLLM: a checkpoint that plait-zero-sharding saves at W=2 (ZeRO-3, after
two training steps) serves through ``LLM(..., load_format="plait_universal")`` with the same greedy
tokens as its HF export, which is served by vLLM as safetensors and by HF ``generate``.

Needs vLLM: it runs in the vLLM environment (ci/test.sh, ``.venv-vllm``); elsewhere it skips.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import plait.universal_ckpt as uc  # noqa: E402
from plait.kernels.testing import run_distributed, train_losses  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integrations" / "vllm" / "tests"))
from vllm_testing import hf_tokens, llama_config, run_engine  # noqa: E402


def save_zero3(root: str) -> list[float]:
    """One rank of W=2: ZeRO-3 AdamW, two steps, then a universal checkpoint of the sharded model."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), lr=1e-3)
    losses = train_losses(model, optimizer, 2, batch=4, seq=16)
    uc.save({"model": model}, root, step=2)
    return losses


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_serves_a_zero3_w2_checkpoint_like_its_hf_export(tmp_path):
    from plait.universal_ckpt.interop.hf import export_hf

    root = tmp_path / "zero3"
    losses = run_distributed(save_zero3, 2, str(root), timeout=240)
    assert all(len(rank) == 2 for rank in losses)
    manifest = uc.read_manifest(uc.latest(root))
    assert manifest.layout.world_size == 2
    assert any(len(entry.pieces) == 2 for entry in manifest.tensors.values()), "expected tensors sharded over 2 ranks"
    llama_config().save_pretrained(root)  # vLLM reads config.json beside the checkpoint
    hf_dir = export_hf(root, tmp_path / "hf", config=llama_config())
    served = run_engine(tmp_path, "--job", f"universal={root}@plait_universal", "--job", f"export={hf_dir}@safetensors",
                        name="result", env={"PLAIT_VLLM": "1"}, timeout=500)
    expected = hf_tokens(transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval())
    assert served["universal"]["tokens"] == expected
    assert served["export"]["tokens"] == expected
    assert "PlaitRMSNorm" in served["universal"]["layers"]
