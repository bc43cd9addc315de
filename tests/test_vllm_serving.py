"""Training to serving through vLLM: a checkpoint that plait-zero-sharding saves at W=2 (ZeRO-3, after
two training steps) serves through ``LLM(..., load_format="plait_universal")`` with the same greedy
tokens as its HF export, which is served by vLLM as safetensors and by HF ``generate``.

Needs vLLM: it runs in the vLLM environment (ci/test.sh, ``.venv-vllm``); elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import plait.universal_ckpt as uc  # noqa: E402
from plait.kernels.testing import run_distributed, train_losses  # noqa: E402

RUNNER = Path(__file__).resolve().parent.parent / "integrations" / "vllm" / "tests" / "vllm_engine_run.py"
PROMPTS = [[1, 17, 42, 99, 5], [7, 7, 300, 12], [250, 3]]  # as in vllm_engine_run.py
NEW_TOKENS = 12


def _config():
    return transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                    max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_zero3(root: str) -> list[float]:
    """One rank of W=2: ZeRO-3 AdamW, two steps, then a universal checkpoint of the sharded model."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), lr=1e-3)
    losses = train_losses(model, optimizer, 2, batch=4, seq=16)
    uc.save({"model": model}, root, step=2)
    return losses


def _hf_tokens(hf_dir: Path) -> list[list[int]]:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0, len(prompt):].tolist())
    return out


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
    _config().save_pretrained(root)  # vLLM reads config.json beside the checkpoint
    hf_dir = export_hf(root, tmp_path / "hf", config=_config())
    out = tmp_path / "result.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PLAIT_VLLM": "1"}
    result = subprocess.run([sys.executable, str(RUNNER), "--job", f"universal={root}@plait_universal",
                             "--job", f"export={hf_dir}@safetensors", "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=500, cwd=tmp_path)
    assert result.returncode == 0 and out.is_file(), (result.stdout + result.stderr)[-5000:]
    served = json.loads(out.read_text())
    expected = _hf_tokens(hf_dir)
    assert served["universal"]["tokens"] == expected
    assert served["export"]["tokens"] == expected
    assert "PlaitRMSNorm" in served["universal"]["layers"]
