"""A sharded HF model saves the real class name in ``config.json``'s ``architectures`` (what vLLM
and ``from_pretrained`` resolve), and the saved weights load back whole."""

from __future__ import annotations

import json

import pytest
import torch

from plait.kernels.testing import run_distributed

transformers = pytest.importorskip("transformers")


def _save_and_reload(path: str) -> tuple[list[str], str, float]:
    from plait.zero_sharding import ZeroConfig, ZeroModule, zero_shard

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model, _ = zero_shard(transformers.LlamaForCausalLM(config), torch.optim.AdamW, ZeroConfig(stage=3), lr=1e-3)
    assert isinstance(model, ZeroModule) and isinstance(model, transformers.LlamaForCausalLM)
    model.save_pretrained(path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(path)
    mine, theirs = model.state_dict(), reloaded.state_dict()
    diff = max((theirs[k] - v).abs().max().item() for k, v in mine.items())
    with open(f"{path}/config.json") as f:
        return json.load(f)["architectures"], model.zero_base_class.__name__, diff


def test_saved_architectures_name_the_base_class(tmp_path):
    architectures, base, diff = run_distributed(_save_and_reload, 1, str(tmp_path), timeout=120)[0]
    assert architectures == ["LlamaForCausalLM"] and base == "LlamaForCausalLM" and diff == 0.0
