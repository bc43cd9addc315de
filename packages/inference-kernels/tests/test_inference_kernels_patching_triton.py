"""One tiny patched HF model run through the Triton kernels (RMSNorm, SiLU-and-mul, rotary) under the
CPU interpreter: generation and logits against the unpatched model, and training gradients.
Kept very small: the interpreter runs every kernel program in Python."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# The root conftest.py sets TRITON_INTERPRET=1 before any import on a machine without CUDA.
transformers = pytest.importorskip("transformers")

from plait.inference_kernels.patching import apply, revert  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


@pytest.fixture
def triton_backend(monkeypatch):
    """Force the Triton path (interpreted) and count launches of each kernel family."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        pytest.fail("triton was imported in compiled mode before this module; set TRITON_INTERPRET=1 in the "
                    "environment before anything imports triton (or run this file on its own).")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "triton")
    from plait.kernels.ops import gated_activation_triton, rms_norm_triton, rotary_triton

    launches: dict[str, int] = {}
    for module, name in ((rms_norm_triton, "rms_norm_forward"), (gated_activation_triton, "gated_forward"),
                         (rotary_triton, "_launch")):
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            launches[_name] = launches.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return launches


def _tiny_qwen3():
    # Qwen3 exercises every patched op, including the per-head q/k RMSNorms, with GQA (2 q heads, 1 kv).
    config = transformers.Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      intermediate_size=96, num_hidden_layers=1, vocab_size=128)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_triton_path_generation_and_logits(triton_backend):
    model = _tiny_qwen3()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens_before = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                       pad_token_id=0)
        logits_before = model(ids).logits
        apply(model)
        tokens_after = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                      pad_token_id=0)
        logits_after = model(ids).logits
    revert(model)
    assert set(triton_backend) == {"rms_norm_forward", "gated_forward", "_launch"}, triton_backend
    assert torch.equal(tokens_after, tokens_before)
    tolerance("hf_patched_logits", torch.float32).assert_close(logits_after, logits_before, what="qwen3 triton")


def test_triton_path_training_gradients(triton_backend):
    model = _tiny_qwen3().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(1))
    apply(model)
    loss = model(ids, labels=ids).loss
    loss.backward()
    revert(model)
    ref_loss = reference(ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)
