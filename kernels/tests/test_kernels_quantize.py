"""Blockwise quantization: Triton against the reference bit for bit, the error bound, edge cases, errors.

The Triton path runs on CUDA when this machine has a GPU, and otherwise under the Triton CPU
interpreter (``TRITON_INTERPRET=1`` with ``PLAIT_KERNEL_BACKEND=triton``). Codes, scales and
dequantized values must be equal bit for bit (the ``quantize_blockwise`` tolerance entries are zero).
"""

from __future__ import annotations

import math

import pytest
import torch

from plait.kernels import dispatch
from plait.kernels.ops import quantize as quantize_module
from plait.kernels.ops.quantize import (
    QMAX,
    code_numel,
    dequantize_blockwise,
    dequantize_blockwise_reference,
    num_blocks,
    quantize_blockwise,
    quantize_blockwise_reference,
    quantized_nbytes,
)
from plait.kernels.tolerances import tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# fp32 slack on the scale/2 bound: y = x / scale rounds once (relative to scale), and code * scale
# rounds once more (half an fp32 ulp of the result, relative to |x|): exact halves, e.g. bf16 inputs
# with x / scale = 63.5, reach scale/2 plus that last rounding.
BOUND_SLACK = 2.0**-20
VALUE_SLACK = 2.0**-22




def _data(numel: int, dtype: torch.dtype, *, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Mixed magnitudes per element, so blocks have very different scales.
    x = torch.randn(numel, generator=gen) * torch.exp(2 * torch.randn(numel, generator=gen))
    return x.to(device=device, dtype=dtype)


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{got.shape} vs {want.dtype}"
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), f"{what}: NaN positions differ"
    if got.is_floating_point():
        tolerance("quantize_blockwise", want.dtype).assert_close(
            got[~nan_got], want[~nan_want], what=what
        )
    else:
        assert torch.equal(got, want), f"{what}: codes differ at {(got != want).nonzero()[:5].flatten().tolist()}"


def _compare_backends(x: torch.Tensor, bits: int, block_size: int, what: str) -> None:
    codes, scales = quantize_blockwise(x, bits=bits, block_size=block_size)
    ref_codes, ref_scales = quantize_blockwise_reference(x.cpu(), bits=bits, block_size=block_size)
    _same_bits(codes.cpu(), ref_codes, f"codes {what}")
    _same_bits(scales.cpu(), ref_scales, f"scales {what}")
    for out_dtype in DTYPES:
        values = dequantize_blockwise(codes, scales, bits=bits, block_size=block_size, numel=x.numel(),
                                      dtype=out_dtype)
        ref = dequantize_blockwise_reference(ref_codes, ref_scales, bits=bits, block_size=block_size,
                                             numel=x.numel(), dtype=out_dtype)
        _same_bits(values.cpu(), ref, f"dequantized->{out_dtype} {what}")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size", (2, 16, 256, 8192))
@pytest.mark.parametrize("numel", (1, 2, 3, 31, 256, 257, 3001))
def test_triton_matches_reference_bitwise(triton_backend, bits, dtype, block_size, numel):
    x = _data(numel, dtype, seed=numel + block_size, device=triton_backend)
    _compare_backends(x, bits, block_size, f"bits={bits} {dtype} block={block_size} numel={numel}")


@pytest.mark.parametrize("bits", (8, 4))
def test_triton_special_values_and_layouts(triton_backend, bits):
    x = _data(1000, torch.float32, seed=7)
    x[3] = math.inf
    x[300] = math.nan
    x[520:600] = 0.0  # part of a block; the whole block 512..575 is not zero
    x[640:704] = 0.0  # a whole 64-block of zeros
    x[800] = -math.inf
    _compare_backends(x.to(triton_backend), bits, 64, "special values")
    # Non-contiguous and multi-dimensional inputs are read flat in row-major order.
    grid = _data(33 * 20, torch.bfloat16, seed=8).view(33, 20).to(triton_backend)
    _compare_backends(grid.t(), bits, 16, "transposed bf16")
    _compare_backends(grid[:, ::3], bits, 8, "strided bf16")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size", (2, 32, 256))
def test_error_bound_half_scale(bits, dtype, block_size):
    numel = 5 * block_size + 3  # a partial last block
    x = _data(numel, dtype, seed=bits * block_size)
    codes, scales = quantize_blockwise(x, bits=bits, block_size=block_size)
    assert codes.numel() == code_numel(numel, bits) and scales.numel() == num_blocks(numel, block_size)
    assert scales.dtype == torch.float32
    values = dequantize_blockwise(codes, scales, bits=bits, block_size=block_size, numel=numel)
    per_element = scales.repeat_interleave(block_size)[:numel]
    err = (x.float() - values).abs()
    bound = per_element / 2 * (1 + BOUND_SLACK) + x.float().abs() * VALUE_SLACK
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3e}"
    # The largest magnitude of each block is reproduced to within an fp32 rounding: nothing clips.
    blocks = torch.nn.functional.pad(x.float().abs(), (0, num_blocks(numel, block_size) * block_size - numel))
    torch.testing.assert_close(scales * QMAX[bits], blocks.view(-1, block_size).amax(dim=1), rtol=2e-7, atol=0)


@pytest.mark.parametrize("bits", (8, 4))
def test_code_ranges_and_packing(bits):
    x = _data(4097, torch.float32, seed=1)
    codes, _ = quantize_blockwise(x, bits=bits, block_size=64)
    if bits == 8:
        assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
        return
    assert codes.dtype == torch.uint8 and codes.numel() == 2049
    low, high = codes.to(torch.int32) & 15, codes.to(torch.int32) >> 4
    # Symmetric codes: -8 (nibble 8) never appears; the odd tail's high nibble is padding zero.
    assert not bool(((low == 8) | (high == 8)).any())
    assert int(high[-1]) == 0


def test_rounding_and_nibble_order_by_hand():
    # absmax 7 gives scale 1.0 for int4 exactly, so the codes are the rounded inputs themselves.
    codes, scales = quantize_blockwise(torch.tensor([7.0, 2.5, -2.5, 0.5, -7.0]), bits=4, block_size=8)
    assert scales.tolist() == [1.0]
    # Halves round away from zero: 2.5 -> 3, -2.5 -> -3 (nibble 13), 0.5 -> 1; element 2i is the low nibble.
    assert codes.tolist() == [7 | (3 << 4), 13 | (1 << 4), 9]
    values = dequantize_blockwise(codes, scales, bits=4, block_size=8, numel=5)
    assert values.tolist() == [7.0, 3.0, -3.0, 1.0, -7.0]
    codes8, scales8 = quantize_blockwise(torch.tensor([127.0, -0.5, 63.5]), bits=8, block_size=2)
    assert codes8.tolist() == [127, -1, 127] and scales8.tolist() == [1.0, 0.5]


def test_zeros_nonfinite_and_empty():
    zeros = torch.zeros(300, dtype=torch.bfloat16)
    codes, scales = quantize_blockwise(zeros, bits=4, block_size=128)
    assert not bool(codes.any()) and not bool(scales.any())
    restored = dequantize_blockwise(codes, scales, bits=4, block_size=128, numel=300, dtype=torch.bfloat16)
    assert torch.equal(restored, zeros)
    x = _data(256, torch.float32, seed=2)
    x[70] = math.nan
    x[200] = math.inf
    codes, scales = quantize_blockwise(x, bits=8, block_size=64)
    assert torch.isnan(scales).tolist() == [False, True, False, True]
    assert not bool(codes[64:128].any()) and not bool(codes[192:].any())
    values = dequantize_blockwise(codes, scales, bits=8, block_size=64, numel=256)
    assert bool(torch.isnan(values[64:128]).all()) and bool(torch.isnan(values[192:]).all())
    assert bool(torch.isfinite(values[:64]).all()) and bool(torch.isfinite(values[128:192]).all())
    empty_codes, empty_scales = quantize_blockwise(torch.empty(0), bits=4, block_size=8)
    assert empty_codes.numel() == 0 and empty_scales.numel() == 0
    assert dequantize_blockwise(empty_codes, empty_scales, bits=4, block_size=8, numel=0).numel() == 0


def test_dequantize_into_out_slice():
    x = _data(100, torch.float32, seed=3)
    codes, scales = quantize_blockwise(x, bits=8, block_size=32)
    buffer = torch.full((300,), 5.0, dtype=torch.float16)
    got = dequantize_blockwise(codes, scales, bits=8, block_size=32, numel=100, dtype=torch.float16,
                               out=buffer[100:200])
    assert got.data_ptr() == buffer[100:200].data_ptr()
    want = dequantize_blockwise_reference(codes, scales, bits=8, block_size=32, numel=100, dtype=torch.float16)
    assert torch.equal(buffer[100:200], want)
    assert bool((buffer[:100] == 5).all()) and bool((buffer[200:] == 5).all())


def test_quantized_nbytes_formula():
    assert quantized_nbytes(1000, bits=8, block_size=256) == 1000 + 4 * 4
    assert quantized_nbytes(1001, bits=4, block_size=256) == 501 + 4 * 4
    assert quantized_nbytes(0, bits=4, block_size=256) == 0


def test_default_cpu_backend_is_reference(monkeypatch):
    monkeypatch.delenv("PLAIT_KERNEL_BACKEND", raising=False)
    assert dispatch.select_backend(torch.zeros(3)) == dispatch.REFERENCE


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 3}, "bits=3"),
        ({"bits": True}, "bits=True"),
        ({"block_size": 48}, "block_size=48"),
        ({"block_size": 1}, "block_size=1"),
        ({"block_size": 2**17}, "power of two"),
    ],
)
def test_quantize_refuses_bad_format(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_blockwise(torch.zeros(8), **kwargs)


def test_refuses_bad_inputs():
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_blockwise([1.0, 2.0])
    with pytest.raises(ValueError, match="x.dtype=torch.int32"):
        quantize_blockwise(torch.zeros(8, dtype=torch.int32))
    codes, scales = quantize_blockwise(torch.ones(10), bits=4, block_size=4)
    with pytest.raises(ValueError, match="codes must be torch.int8 with 10"):
        dequantize_blockwise(codes, scales, bits=8, block_size=4, numel=10)
    with pytest.raises(ValueError, match="codes must be torch.uint8 with 6"):
        dequantize_blockwise(codes, scales, bits=4, block_size=4, numel=12)
    with pytest.raises(ValueError, match="scales must be float32 with 2"):
        dequantize_blockwise(codes, scales, bits=4, block_size=8, numel=10)
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        dequantize_blockwise(codes, scales, bits=4, block_size=4, numel=10, dtype=torch.float64)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_blockwise(codes, scales, bits=4, block_size=4, numel=10, out=torch.zeros(9))
    with pytest.raises(ValueError, match="numel=-1"):
        dequantize_blockwise(codes, scales, bits=4, block_size=4, numel=-1)


def _format_by_definition(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The format as the module docstring states it, one step per line (slow; the reference's oracle):
    per block, scale = max|x| / qmax (NaN if any element is not finite), code = sign(x / scale) *
    floor(|x / scale| + 0.5) clamped to qmax, 0 where the scale is 0 or NaN; int4 packed low nibble first."""
    qmax = float(QMAX[bits])
    numel = x.numel()
    blocks = -(-numel // block_size)
    padded = torch.nn.functional.pad(x.reshape(-1).float(), (0, blocks * block_size - numel)).view(blocks, block_size)
    magnitude = padded.abs()
    finite = magnitude < math.inf
    absmax = torch.where(finite, magnitude, 0.0).amax(dim=1) if blocks else magnitude.new_zeros(0)
    scales = torch.where(finite.all(dim=1), absmax / qmax, math.nan)
    usable = scales > 0
    y = torch.where(usable[:, None], padded / torch.where(usable, scales, 1.0)[:, None], 0.0)
    codes = torch.clamp(torch.floor(y.abs() + 0.5), max=qmax)
    codes = torch.where(y < 0, -codes, codes).to(torch.int32).view(-1)[:numel]
    if bits == 8:
        return codes.to(torch.int8), scales
    codes = torch.nn.functional.pad(codes, (0, numel % 2))
    pairs = (codes & 15).view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8), scales


@pytest.mark.parametrize("chunk", [None, 6], ids=["default-chunks", "many-chunks"])
@pytest.mark.parametrize("bits", [8, 4])
def test_reference_is_the_format_by_definition_bitwise(bits, chunk, monkeypatch):
    """The reference's fused passes (amax propagating NaN, clamp then y + copysign(0.5, y) cast to int8)
    and its chunking (here also 1-3 blocks a chunk, a partial last chunk) change no bit."""
    if chunk is not None:
        monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    specials = torch.randn(3000) * 10
    specials[5], specials[600], specials[900] = math.inf, -math.inf, math.nan
    specials[1200:1456] = 0.0
    cases = [specials, torch.arange(-300, 300) * 0.5, torch.full((512,), -0.0), torch.randn(1000) * 1e-30,
             torch.randn(1000) * 3e38, torch.randn(257).bfloat16(), torch.randn(1001).half(), torch.empty(0)]
    for x in cases:
        for block_size in (2, 64, 256):
            codes, scales = quantize_blockwise_reference(x, bits=bits, block_size=block_size)
            want_codes, want_scales = _format_by_definition(x, bits, block_size)
            assert codes.dtype == want_codes.dtype and torch.equal(codes, want_codes), (x.numel(), block_size)
            assert torch.equal(scales.nan_to_num(-1.0), want_scales.nan_to_num(-1.0)), (x.numel(), block_size)


def _dequantize_by_definition(codes, scales, bits, block_size, numel, dtype):
    """``code * scale`` as the module docstring states it, one element at a time in spirit: int4 nibbles
    read low first and sign-extended as 4-bit two's complement, one fp32 scale per block, cast once."""
    if bits == 8:
        values = codes.to(torch.int32)
    else:
        packed = codes.to(torch.int32)
        nibbles = torch.stack((packed & 15, packed >> 4), dim=1).view(-1)[:numel]
        values = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return (values.to(torch.float32) * scales.repeat_interleave(block_size)[:numel]).to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dequantize_reference_is_the_format_by_definition_bitwise(bits, dtype):
    """The reference's direct writes (codes widened into the output, nibbles by arithmetic shifts, the
    scale broadcast per block) change no bit: every code value, -8 included, NaN / 0 / huge scales,
    partial blocks, odd counts, and into a caller's buffer."""
    gen = torch.Generator().manual_seed(bits)
    for numel in (0, 1, 2, 3, 63, 64, 65, 255, 256, 1000, 1024):
        for block_size in (2, 64, 256):
            blocks = num_blocks(numel, block_size)
            if bits == 8:
                codes = torch.randint(-128, 128, (numel,), generator=gen, dtype=torch.int8)
            else:
                codes = torch.randint(0, 256, (code_numel(numel, 4),), generator=gen, dtype=torch.uint8)
            scales = torch.rand(blocks, generator=gen) * 10.0 ** torch.randint(-40, 37, (blocks,), generator=gen)
            if blocks > 2:
                scales[0], scales[1], scales[2] = math.nan, 0.0, 3e38
            want = _dequantize_by_definition(codes, scales, bits, block_size, numel, dtype)
            got = dequantize_blockwise_reference(codes, scales, bits=bits, block_size=block_size, numel=numel,
                                                 dtype=dtype)
            out = torch.full((numel + 4,), 7.0, dtype=dtype)
            into = dequantize_blockwise_reference(codes, scales, bits=bits, block_size=block_size, numel=numel,
                                                  dtype=dtype, out=out[2:numel + 2])
            for what, tensor in (("returned", got), ("into out", into)):
                assert tensor.dtype == dtype and tensor.shape == want.shape, (what, numel, block_size)
                assert torch.equal(tensor.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                   want.view(torch.int16 if dtype != torch.float32 else torch.int32)), \
                    (what, numel, block_size)
            assert out[:2].tolist() == [7.0, 7.0] and out[numel + 2:].tolist() == [7.0, 7.0]
