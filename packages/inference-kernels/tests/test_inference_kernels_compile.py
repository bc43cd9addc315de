"""A model patched by plait-inference-kernels traces under torch.compile without graph breaks."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.inference_kernels.patching import PatchConfig, apply, forwards, revert  # noqa: E402


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_patched_llama_traces_in_one_graph(monkeypatch, grad):
    """dynamo reports no graph break for a patched HF Llama (RMSNorm, fused MLP and rotary all plait's),
    and the traced forward reached plait's ops."""
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      intermediate_size=256, num_hidden_layers=1, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    report = apply(model, PatchConfig(policy="always"))
    try:
        assert report.patched["rms_norm"] and report.patched["mlp"] and report.patched["attention_rotary"], report
        rotary = "rotary_embedding" if grad else "rotate_neox_in_place"
        calls: dict[str, int] = {}
        for name in ("rms_norm_reference", "gated_activation_reference", rotary):
            original = getattr(forwards, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(forwards, name, spy)
        ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
        with torch.set_grad_enabled(grad):
            explained = torch._dynamo.explain(lambda ids: model(ids).logits)(ids)
        assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
        assert explained.graph_count == 1
        assert set(calls) == {"rms_norm_reference", "gated_activation_reference", rotary}, calls
    finally:  # a patched model left alive (dynamo's caches hold it) would keep the rotary hook installed
        revert(model)
        torch._dynamo.reset()
