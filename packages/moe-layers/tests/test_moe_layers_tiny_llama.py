"""tiny-llama-MoE converted to plait MoE layers: same logits, overrides applied, bad input refused."""

from __future__ import annotations

import copy

import pytest
import torch

from plait.kernels.testing import global_batch, tiny_llama, tiny_llama_moe
from plait.moe_layers import MoE, moe_layers
from plait.moe_layers.tiny_llama import convert_tiny_llama_moe

MODEL = dict(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=48, vocab_size=300, num_experts=4)


def test_converted_tiny_llama_moe_keeps_logits_and_takes_overrides() -> None:
    torch.manual_seed(0)
    loop = tiny_llama_moe(**MODEL).eval()
    converted = copy.deepcopy(loop)
    assert convert_tiny_llama_moe(converted) == 1
    ids = global_batch(0, 2, 16)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, loop(ids).logits, atol=1e-5, rtol=1e-4)
    grin = copy.deepcopy(loop)
    convert_tiny_llama_moe(grin, router_gradient="grin")
    layer, = moe_layers(grin)
    assert isinstance(layer, MoE) and layer.config.router_gradient == "grin" and not layer.training


def test_model_without_loop_moe_refused() -> None:
    with pytest.raises(ValueError, match="found no MoEMLP"):
        convert_tiny_llama_moe(tiny_llama(num_layers=1, hidden_size=32, num_heads=2, vocab_size=300))
