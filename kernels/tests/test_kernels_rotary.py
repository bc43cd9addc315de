"""Rotary embedding: the Triton kernel (under the interpreter) against the reference, in place and
out of place with gradients, NeoX and GPT-J layouts, partial rotary, GQA head counts, arbitrary
positions, odd and non-contiguous layouts; the reference against independent formulas; bad input
refused before launch."""

from __future__ import annotations

import math

import pytest
import torch

from plait.kernels.ops.rotary import apply_rotary, rotary_cos_sin, rotary_embedding
from plait.kernels.tolerances import tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]

# (name, q_heads, k_heads, head_size, rotary_dim)
CONFIGS = [
    ("gqa_full", 4, 2, 64, None),
    ("partial", 3, 1, 80, 32),
    ("tiny_odd_heads", 5, 3, 6, 4),
]




def _qk(layout: str, q_heads: int, k_heads: int, head_size: int, dtype, seed: int = 0):
    """q, k and positions in one of the layouts the op accepts."""
    gen = torch.Generator().manual_seed(seed)
    tokens = 7
    if layout == "flat":  # vLLM: [tokens, heads * head_size]
        q = torch.randn(tokens, q_heads * head_size, generator=gen)
        k = torch.randn(tokens, k_heads * head_size, generator=gen)
        positions = torch.randint(0, 50, (tokens,), generator=gen)
    elif layout == "qkv_slices":  # q and k are column slices of one fused qkv projection
        qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_size, generator=gen)
        q = qkv[:, : q_heads * head_size]
        k = qkv[:, q_heads * head_size : (q_heads + k_heads) * head_size]
        positions = torch.randint(0, 50, (tokens,), generator=gen, dtype=torch.int64).to(torch.int32)
    elif layout == "bshd":  # [batch, seq, heads, head_size] with [batch, seq] positions
        q = torch.randn(2, 3, q_heads, head_size, generator=gen)
        k = torch.randn(2, 3, k_heads, head_size, generator=gen)
        positions = torch.tensor([[0, 1, 2], [40, 41, 42]])
    elif layout == "bhsd_transposed":  # HF's [b, h, s, d] viewed back as [b, s, h, d]: not collapsible
        q = torch.randn(2, q_heads, 3, head_size, generator=gen).transpose(1, 2)
        k = torch.randn(2, k_heads, 3, head_size, generator=gen).transpose(1, 2)
        positions = torch.tensor([[5, 6, 7], [0, 9, 3]])
    else:
        raise AssertionError(layout)
    return q.to(dtype), k.to(dtype), positions


LAYOUTS = ("flat", "qkv_slices", "bshd", "bhsd_transposed")


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_in_place_matches_reference(triton_backend, monkeypatch, layout, config, dtype, is_neox):
    _, q_heads, k_heads, head_size, rotary_dim = config
    q, k, positions = _qk(layout, q_heads, k_heads, head_size, dtype)
    cache = rotary_cos_sin(64, rotary_dim or head_size)
    kwargs = dict(head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox)

    q_kernel, k_kernel = q.clone(), k.clone()
    if layout == "qkv_slices":  # keep the slices' strides: rotate views of a fresh fused buffer
        q_kernel, k_kernel = _qk(layout, q_heads, k_heads, head_size, dtype)[:2]
    q_ptr = q_kernel.data_ptr()
    out_q, out_k = apply_rotary(q_kernel, k_kernel, cache, positions, **kwargs)
    assert out_q is q_kernel and out_k is k_kernel and q_kernel.data_ptr() == q_ptr

    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "reference")
    q_ref, k_ref = apply_rotary(q.clone(), k.clone(), cache, positions, **kwargs)
    tol = tolerance("rotary_fwd", dtype)
    tol.assert_close(q_kernel, q_ref, what=f"rotary q {layout} {config[0]} {dtype}")
    tol.assert_close(k_kernel, k_ref, what=f"rotary k {layout} {config[0]} {dtype}")
    if rotary_dim is not None:  # partial rotary leaves the tail bit-identical
        def heads(x):
            return x.unflatten(-1, (-1, head_size)) if x.dim() == 2 else x

        assert torch.equal(heads(q_kernel)[..., rotary_dim:], heads(q)[..., rotary_dim:])
        assert torch.equal(heads(k_kernel)[..., rotary_dim:], heads(k)[..., rotary_dim:])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
@pytest.mark.parametrize("layout", ("flat", "bhsd_transposed"))
def test_triton_out_of_place_forward_and_backward(triton_backend, monkeypatch, layout, config, dtype, is_neox):
    _, q_heads, k_heads, head_size, rotary_dim = config
    q, k, positions = _qk(layout, q_heads, k_heads, head_size, dtype)
    cos, sin = rotary_cos_sin(64, rotary_dim or head_size).chunk(2, dim=-1)  # the (cos, sin) form
    kwargs = dict(head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox)
    grad_q, grad_k, _ = _qk(layout, q_heads, k_heads, head_size, dtype, seed=1)

    def run():
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        out_q, out_k = rotary_embedding(qq, kk, (cos, sin), positions, **kwargs)
        torch.autograd.backward((out_q, out_k), (grad_q, grad_k))
        return out_q, out_k, qq.grad, kk.grad

    kernel = run()
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "reference")
    reference = run()
    assert kernel[0].shape == q.shape and kernel[1].shape == k.shape
    for i, name in enumerate(("q", "k", "dq", "dk")):
        op = "rotary_fwd" if i < 2 else "rotary_bwd"
        tolerance(op, dtype).assert_close(kernel[i], reference[i], what=f"{name} {layout} {config[0]} {dtype}")


def test_backward_is_rotation_by_minus_theta():
    q, k, positions = _qk("flat", 2, 1, 16, torch.float32)
    cache = rotary_cos_sin(64, 16)
    qq = q.clone().requires_grad_()
    out_q, _ = rotary_embedding(qq, None, cache, positions, head_size=16)
    out_q.backward(out_q.detach())  # gradient = the rotated q: rotating back must give q
    torch.testing.assert_close(qq.grad, q, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_reference_matches_independent_formulas(is_neox):
    head_size, base = 8, 10000.0
    q, _, positions = _qk("flat", 2, 1, head_size, torch.float32)
    cache = rotary_cos_sin(64, head_size, base)
    out, _ = rotary_embedding(q, None, cache, positions, head_size=head_size, is_neox=is_neox)
    x = q.double().unflatten(-1, (2, head_size))
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angle = positions.double()[:, None, None] * inv_freq  # [tokens, 1, half]
    rotor = torch.polar(torch.ones_like(angle), angle)
    if is_neox:  # channel i pairs with i + half, as complex x_i + j x_{i+half}
        half = head_size // 2
        z = torch.complex(x[..., :half], x[..., half:]) * rotor
        expected = torch.cat((z.real, z.imag), dim=-1)
    else:  # GPT-J: channel 2i pairs with 2i+1
        z = torch.complex(x[..., 0::2], x[..., 1::2]) * rotor
        expected = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    torch.testing.assert_close(out.double(), expected.flatten(-2), atol=2e-5, rtol=1e-5)


def test_neox_reference_is_bitwise_hf_formula_in_fp32():
    q, _, positions = _qk("bshd", 2, 1, 16, torch.float32)
    cache = rotary_cos_sin(64, 16)
    half_cos, half_sin = cache[positions].chunk(2, dim=-1)
    cos = torch.cat((half_cos, half_cos), -1).unsqueeze(-2)
    sin = torch.cat((half_sin, half_sin), -1).unsqueeze(-2)
    rotate_half = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
    hf = q * cos + rotate_half * sin
    out, _ = rotary_embedding(q, None, cache, positions, head_size=16)
    assert torch.equal(out, hf)


def test_cache_and_pair_forms_agree_and_cos_sin_values():
    cache = rotary_cos_sin(10, 4, base=100.0)
    assert cache.shape == (10, 4)
    assert math.isclose(cache[3, 1].item(), math.cos(3 * 100.0 ** (-0.5)), rel_tol=1e-6)
    assert math.isclose(cache[3, 3].item(), math.sin(3 * 100.0 ** (-0.5)), rel_tol=1e-6)
    q, k, positions = _qk("flat", 2, 1, 4, torch.float32)
    positions = positions % 10
    a = rotary_embedding(q, k, cache, positions, head_size=4)
    b = rotary_embedding(q, k, tuple(cache.chunk(2, -1)), positions, head_size=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_position_zero_is_identity_and_k_may_be_none():
    q, _, _ = _qk("flat", 3, 1, 8, torch.bfloat16)
    out, none = apply_rotary(q.clone(), None, rotary_cos_sin(4, 8), torch.zeros(7, dtype=torch.int64), head_size=8)
    assert none is None and torch.equal(out, q)


def test_triton_k_none_and_empty(triton_backend):
    q, _, positions = _qk("flat", 3, 1, 8, torch.float32)
    cache = rotary_cos_sin(64, 8)
    out, _ = apply_rotary(q.clone(), None, cache, positions, head_size=8)
    expected, _ = rotary_embedding(q, None, cache, positions, head_size=8)
    tolerance("rotary_fwd", torch.float32).assert_close(out, expected)
    empty = torch.zeros(0, 16)
    assert apply_rotary(empty, None, cache, torch.zeros(0, dtype=torch.int64), head_size=8)[0] is empty


def _call(**overrides):
    q, k, positions = _qk("flat", 2, 1, 8, torch.float32)
    args = dict(q=q, k=k, cos_sin=rotary_cos_sin(64, 8), positions=positions, head_size=8)
    args.update(overrides)
    return apply_rotary(args.pop("q"), args.pop("k"), args.pop("cos_sin"), args.pop("positions"), **args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(rotary_dim=5), "rotary_dim"),
        (dict(rotary_dim=16), "rotary_dim"),
        (dict(head_size=7), "head_size=7"),
        (dict(head_size=0), "head_size"),
        (dict(q=torch.zeros(7, 16, dtype=torch.float64)), "dtype"),
        (dict(k=torch.zeros(7, 8, dtype=torch.float16)), "must match"),
        (dict(k=torch.zeros(6, 8)), "token dims"),
        (dict(positions=torch.full((7,), 64)), "positions span"),
        (dict(positions=torch.full((7,), -1)), "positions span"),
        (dict(positions=torch.zeros(7)), "int32/int64"),
        (dict(positions=torch.zeros(6, dtype=torch.int64)), "positions have shape"),
        (dict(cos_sin=torch.zeros(64, 6)), "cos_sin_cache"),
        (dict(cos_sin=(torch.zeros(64, 4), torch.zeros(32, 4))), "rows"),
        (dict(cos_sin=(torch.zeros(64, 8), torch.zeros(64, 8))), "rotary_dim/2"),
        (dict(cos_sin=torch.zeros(64, 8, dtype=torch.int32)), "dtype"),
    ],
)
def test_bad_input_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


def test_bad_input_is_refused_on_the_triton_path_before_launch(triton_backend):
    with pytest.raises(ValueError, match="positions span"):
        _call(positions=torch.full((7,), 1000))
    with pytest.raises(ValueError, match="rotary_dim"):
        _call(rotary_dim=3)


def test_in_place_refuses_tensors_that_need_grad():
    q, k, positions = _qk("flat", 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="rotary_embedding"):
        apply_rotary(q.requires_grad_(), k, rotary_cos_sin(64, 8), positions, head_size=8)
    with torch.no_grad():
        apply_rotary(q, k, rotary_cos_sin(64, 8), positions, head_size=8)


def test_rotary_cos_sin_validation():
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_cos_sin(8, 3)
    with pytest.raises(ValueError, match="max_positions"):
        rotary_cos_sin(0, 4)
    with pytest.raises(ValueError, match="base"):
        rotary_cos_sin(8, 4, base=1.0)


def test_rotary_module_in_place_for_inference_and_differentiable_for_training():
    from plait.kernels.ops import RotaryEmbedding

    layer = RotaryEmbedding(8, 8, 64)
    q, k, positions = _qk("flat", 2, 1, 8, torch.float32)
    expected = rotary_embedding(q, k, layer.cos_sin_cache, positions, head_size=8)
    with torch.no_grad():
        qq, kk = q.clone(), k.clone()
        out_q, out_k = layer(positions, qq, kk)
    assert out_q is qq and torch.equal(out_q, expected[0]) and torch.equal(out_k, expected[1])
    trainable = q.clone().requires_grad_()
    out_q, _ = layer(positions, trainable, None)
    out_q.sum().backward()
    assert trainable.grad is not None and out_q is not trainable
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, 10, 64)
