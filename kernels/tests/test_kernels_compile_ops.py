"""RoPE, blockwise quantization and 1-bit sign compression as ``torch.library`` custom ops:
``opcheck`` on small shapes, RoPE's registered backward equal to eager autograd bit for bit, and
each public function under ``torch.compile(fullgraph=True)`` (no graph break, no data-dependent
guard) equal to eager, bit for bit on the CPU path."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.ops import (
    apply_rotary,
    compress_with_error_feedback,
    dequantize_blockwise,
    pack_signs,
    quantize_blockwise,
    rotary_cos_sin,
    rotary_embedding,
    unpack_bits,
    unpack_signs,
)
from plait.kernels.ops.sign import unpack_scaled_signs

# As in test_kernels_compile.py: without opcheck's compile-per-op test (the compiled tests below
# trace every op through dynamo and AOTAutograd).
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")
HEAD, HEADS, KV_HEADS, TOKENS = 16, 4, 2, 6


def _rotary_inputs(dtype=torch.float32, rotary_dim=HEAD):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(TOKENS, HEADS * HEAD, generator=gen).to(dtype)
    k = torch.randn(TOKENS, KV_HEADS * HEAD, generator=gen).to(dtype)
    positions = torch.tensor([5, 0, 3, 3, 9, 1])
    return q, k, rotary_cos_sin(16, rotary_dim), positions


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")


def test_rotary_opcheck():
    q, _, cache, positions = _rotary_inputs()
    cos, sin = cache[:, :HEAD // 2], cache[:, HEAD // 2:]
    q4 = q.view(TOKENS, HEADS, HEAD)
    torch.library.opcheck(torch.ops.plait.rotary.default,
                          (q4.clone().requires_grad_(), cos, sin, positions, HEAD, True, False, True, False),
                          test_utils=OPCHECK_TESTS)
    torch.library.opcheck(torch.ops.plait.rotary_.default, (q4.clone(), cos, sin, positions, HEAD, False, True, False),
                          test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize(("dtype", "rotary_dim", "is_neox"),
                         [(torch.float32, HEAD, True), (torch.bfloat16, 12, False)])
def test_rotary_embedding_compiled_equals_eager_autograd_bitwise(dtype, rotary_dim, is_neox):
    """Outputs and the q/k gradients (the op's backward, the inverse rotation) are eager's bits."""
    q, k, cache, positions = _rotary_inputs(dtype, rotary_dim)

    def fn(q, k):
        q_out, k_out = rotary_embedding(q, k, cache, positions, head_size=HEAD, rotary_dim=rotary_dim,
                                        is_neox=is_neox)
        return torch.cat((q_out, k_out), dim=-1)

    results = []
    for run in (fn, _compiled(fn)):
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
        out = run(*leaves)
        out.float().square().sum().backward()
        results.append((out.detach(), leaves[0].grad, leaves[1].grad))
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)


def test_apply_rotary_compiled_rotates_in_place_as_eager():
    q, k, cache, positions = _rotary_inputs()

    def fn(q, k):
        apply_rotary(q, k, cache, positions, head_size=HEAD)
        return q.sum()

    eager_q, eager_k = q.clone(), k.clone()
    fn(eager_q, eager_k)
    compiled_q, compiled_k = q.clone(), k.clone()
    _compiled(fn)(compiled_q, compiled_k)
    assert torch.equal(compiled_q, eager_q) and torch.equal(compiled_k, eager_k)


def test_rotary_compiled_refuses_positions_outside_the_table_before_writing():
    q, k, cache, _ = _rotary_inputs()
    far = torch.tensor([5, 0, 3, 3, 99, 1])
    fn = _compiled(lambda q, k, p: apply_rotary(q, k, cache, p, head_size=HEAD))
    before_q, before_k = q.clone(), k.clone()
    with pytest.raises(ValueError, match=r"positions span \[0, 99\] but the angle table has 16 rows"):
        fn(q, k, far)
    assert torch.equal(q, before_q) and torch.equal(k, before_k)


# ---- blockwise quantization (ZeRO++) --------------------------------------------------------
def _to_quantize():
    x = torch.randn(2, 301, generator=torch.Generator().manual_seed(1))
    x[0, :64] = 0.0  # an all-zero block (scale 0), and a partial last block
    return x


def test_quantize_opcheck():
    x = _to_quantize()
    for bits in (8, 4):
        torch.library.opcheck(torch.ops.plait.quantize_blockwise.default, (x, bits, 64, False),
                              test_utils=OPCHECK_TESTS)
        codes, scales = quantize_blockwise(x, bits=bits, block_size=64)
        torch.library.opcheck(torch.ops.plait.dequantize_blockwise.default,
                              (codes, scales, bits, 64, x.numel(), torch.bfloat16, False), test_utils=OPCHECK_TESTS)
        torch.library.opcheck(torch.ops.plait.dequantize_blockwise_into.default,
                              (codes, scales, bits, 64, x.numel(), torch.empty(x.numel()), False),
                              test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_round_trip_compiled_equals_eager_bitwise(bits):
    def fn(x, out):
        codes, scales = quantize_blockwise(x * 2.0, bits=bits, block_size=64)
        fresh = dequantize_blockwise(codes, scales, bits=bits, block_size=64, numel=x.numel(), dtype=torch.bfloat16)
        dequantize_blockwise(codes, scales, bits=bits, block_size=64, numel=x.numel(), out=out)
        return codes, scales, fresh

    x = _to_quantize()
    eager_out, compiled_out = torch.empty(x.numel()), torch.empty(x.numel())
    eager = fn(x, eager_out)
    compiled = _compiled(fn)(x, compiled_out)
    for got, want in zip((*compiled, compiled_out), (*eager, eager_out), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


# ---- 1-bit sign compression (1-bit Adam / LAMB) ---------------------------------------------
def test_sign_opcheck():
    x = torch.randn(45, generator=torch.Generator().manual_seed(2))
    packed = pack_signs(x)
    checks = [(torch.ops.plait.pack_signs.default, (x, False)),
              (torch.ops.plait.unpack_signs.default, (packed, 45, True, False)),
              (torch.ops.plait.unpack_signs.default, (packed, 45, False, False)),
              (torch.ops.plait.unpack_scaled_signs.default, (packed, 45, torch.tensor(0.5), False)),
              (torch.ops.plait.compress_with_error_feedback.default, (x, torch.randn(45), False))]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)


def test_sign_compression_compiled_equals_eager_bitwise():
    """Compress with error feedback, then decode: packed bits, scale, the updated error and every
    decoded form equal eager's; the error buffer is updated in place under compile too."""
    def fn(x, error, out):
        packed, scale = compress_with_error_feedback(x, error)
        unpack_scaled_signs(packed, x.numel(), scale, out=out)
        return (packed, scale, pack_signs(x), unpack_signs(packed, x.numel()), unpack_bits(packed, x.numel()),
                unpack_scaled_signs(packed, x.numel(), scale))

    gen = torch.Generator().manual_seed(3)
    x, error = torch.randn(45, generator=gen), torch.randn(45, generator=gen) * 0.1
    eager_error, compiled_error = error.clone(), error.clone()
    eager_out, compiled_out = torch.empty(45), torch.empty(45)
    eager = fn(x, eager_error, eager_out)
    compiled = _compiled(fn)(x, compiled_error, compiled_out)
    for got, want in zip((*compiled, compiled_error, compiled_out), (*eager, eager_error, eager_out), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
