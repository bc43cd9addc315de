"""What the vLLM engine tests share: the prompts, a tiny model of each family plait-vllm serves,
the greedy tokens HF's ``generate`` gives for them, and one engine run in a fresh process.

An engine run (``vllm_engine_run.py``) starts one or more ``LLM()`` engines one after the other in
a process of its own and writes what each served to a JSON file; vLLM's CPU engine keeps global
state, so one test process never starts an engine itself. Imported by path (the tests run with
``--import-mode=importlib``), by ``vllm_engine_run.py`` for the prompts, and by the top-level
training-to-vLLM test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("vllm_engine_run.py")
PROMPTS = [[1, 17, 42, 99, 5], [7, 7, 300, 12], [250, 3]]
NEW_TOKENS = 12
# The tiny shape every family shares: head_dim 64 (vLLM's CPU attention needs >= 64), no special
# tokens (generation runs exactly NEW_TOKENS), and weights large enough to make greedy choices clear.
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
            initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# vLLM's CPU engine in-process (no engine-core subprocess), a small KV cache, and plait's own
# objects (the universal-checkpoint loader's settings) allowed through vLLM's serialisation.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def llama_config(**overrides: Any):
    """The tiny Llama config (``TINY`` with ``overrides``)."""
    import transformers

    return transformers.LlamaConfig(**{**TINY, **overrides})


def tiny_model(family: str = "llama"):
    """A seeded tiny model of ``family`` (llama, mixtral, gemma, qwen2_moe, qwen3_moe) in eval mode,
    with norm weights drawn away from 1 so that a skipped or wrong norm shows in the tokens."""
    import torch
    import transformers

    common = dict(TINY, rms_norm_eps=1e-6)
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        cls = transformers.MixtralForCausalLM
    elif family == "gemma":  # tanh-GELU GeGLU; Gemma ties its LM head to the embedding, as vLLM's Gemma does
        config = transformers.GemmaConfig(**{**common, "tie_word_embeddings": True})
        cls = transformers.GemmaForCausalLM
    elif family == "qwen3_moe":  # 4 routed experts, top-2, renormalised; q/k RMSNorm per head
        config = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":  # every layer sparse: 4 routed experts, top-2, plus the gated shared expert
        config = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                             shared_expert_intermediate_size=256, **common)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        raise ValueError(f"family={family!r}: give llama, mixtral, gemma, qwen2_moe or qwen3_moe")
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def hf_tokens(model) -> list[list[int]]:
    """HF ``generate``'s greedy continuation of every prompt (exactly NEW_TOKENS each)."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0, len(prompt):].tolist())
    return out


def run_engine(tmp: Path, *args: str, name: str = "engine", env: dict[str, str] | None = None,
               timeout: float = 400) -> dict:
    """Run ``vllm_engine_run.py ARGS`` in a fresh process (cwd ``tmp``) and return what it served.

    Raises:
        AssertionError: the run failed or wrote no result, with the tail of its output.
    """
    out = tmp / f"{name}.json"
    result = subprocess.run([sys.executable, str(RUNNER), *args, "--out", str(out)], capture_output=True, text=True,
                            env={**os.environ, **ENGINE_ENV, **(env or {})}, timeout=timeout, cwd=tmp)
    assert result.returncode == 0 and out.is_file(), \
        f"engine run {name} failed (rc {result.returncode}):\n{(result.stdout + result.stderr)[-5000:]}"
    return json.loads(out.read_text())
