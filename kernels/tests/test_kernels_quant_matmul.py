"""Weight-only quantized matmul: formats, round trips, byte formula, the Triton kernel (under the
interpreter on CPU) and torch's CPU int8/int4 kernels against the torch reference, the custom
op under torch.compile, and refusals of bad input."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.ops.quant_matmul import (
    FP6_MAX,
    FP6_VALUES,
    QuantScheme,
    dense_matmul_cpu,
    dequantize_weight,
    int4_matmul_cpu,
    int8_matmul_cpu,
    pack_fp6,
    pack_int4,
    prepack_int4_cpu,
    quant_matmul,
    quant_matmul_reference,
    quantize_weight,
    unpack_fp6,
    unpack_int4,
    weight_nbytes,
)
from plait.kernels.tolerances import tolerance

SCHEMES = [
    QuantScheme(kind="int8"),
    QuantScheme(kind="int4", group_size=32),
    QuantScheme(kind="int4", group_size=64, symmetric=False),
    QuantScheme(kind="int4", group_size=128),
    QuantScheme(kind="fp6"),
]


def _ids(s: QuantScheme) -> str:
    return f"{s.kind}-g{s.group_size}-{'sym' if s.symmetric else 'asym'}"


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _stored_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("scheme", SCHEMES, ids=_ids)
def test_round_trip_error_is_bounded_by_half_a_step_and_bytes_match_the_formula(scheme):
    w = _weight(48, 256, seed=1)
    codes, scales, zeros = quantize_weight(w, scheme)
    assert _stored_bytes(codes, scales, zeros) == weight_nbytes((48, 256), scheme)
    err = (dequantize_weight(codes, scales, zeros, scheme) - w).abs()
    if scheme.kind == "fp6":
        # e3m2's widest step is 4 (between 24 and 28), so half a step is 2 * scale; relative to
        # each value it is at most 1/8 (2 mantissa bits) above the subnormal range.
        bound = 2.0 * scales.expand_as(w) + 1e-7
    elif scheme.kind == "int8":
        bound = scales.expand_as(w) / 2 + 1e-7
    else:
        bound = scales.repeat_interleave(scheme.group_size, dim=1) / 2 + 1e-7
    assert bool((err <= bound).all())
    assert err.max() > 0  # it did quantize


def test_int4_and_fp6_packing_round_trip_and_fp6_values():
    q = torch.randint(0, 16, (5, 64))
    assert torch.equal(unpack_int4(pack_int4(q)), q.to(torch.uint8))
    c = torch.randint(0, 64, (3, 32))
    assert torch.equal(unpack_fp6(pack_fp6(c)), c)
    assert FP6_VALUES[31] == FP6_MAX and FP6_VALUES[1] == 0.0625 and FP6_VALUES[63] == -FP6_MAX
    # Every representable value (times a scale) round-trips exactly.
    w = (FP6_VALUES[:32].repeat(2) * torch.tensor([1.0] * 32 + [-1.0] * 32)).reshape(1, 64) * 0.5
    codes, scales, _ = quantize_weight(w, QuantScheme(kind="fp6"))
    assert torch.equal(dequantize_weight(codes, scales, None, QuantScheme(kind="fp6")), w)


def test_zero_rows_dequantize_to_exact_zeros():
    w = _weight(4, 64, seed=2)
    w[1] = 0
    for scheme in SCHEMES[:3] + SCHEMES[4:]:
        codes, scales, zeros = quantize_weight(w, scheme)
        assert torch.equal(dequantize_weight(codes, scales, zeros, scheme)[1], torch.zeros(64))


@pytest.mark.parametrize("scheme", SCHEMES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(triton_backend, scheme, dtype):
    w = _weight(40, 256, seed=3)
    codes, scales, zeros = quantize_weight(w, scheme)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(5))
    dev = triton_backend
    moved = [t.to(dev) if t is not None else None for t in (x, codes, scales, zeros, bias)]
    got = quant_matmul(moved[0], moved[1], moved[2], moved[3], scheme, moved[4]).cpu()
    want = quant_matmul_reference(x, codes, scales, zeros, scheme, bias)
    assert got.shape == (3, 5, 40) and got.dtype == dtype
    tolerance("quant_matmul_triton", dtype).assert_close(got, want, what=f"{_ids(scheme)} {dtype}")


@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[1], SCHEMES[2]], ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_cpu_kernels_match_reference(scheme, dtype):
    w = _weight(64, 512, seed=6)
    codes, scales, zeros = quantize_weight(w, scheme)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(7)).to(dtype)
    if scheme.kind == "int8":
        got = int8_matmul_cpu(x, codes, scales)
    else:
        packed, sz = prepack_int4_cpu(codes, scales, zeros, scheme, dtype)
        got = int4_matmul_cpu(x, packed, sz, scheme.group_size)
    want = quant_matmul_reference(x, codes, scales, zeros, scheme)
    tolerance("quant_matmul_cpu", dtype).assert_close(got, want, what=f"{_ids(scheme)} {dtype}")


@pytest.mark.parametrize(("scheme", "dtype"), [(s, torch.float32) for s in SCHEMES] + [(SCHEMES[2], torch.bfloat16)],
                         ids=lambda v: _ids(v) if isinstance(v, QuantScheme) else str(v))
def test_dense_blocked_cpu_path_matches_reference(scheme, dtype):
    # N = 200 with blocks of 64 rows: three full blocks and a partial one; a 3-D input.
    w = _weight(200, 256, seed=8)
    codes, scales, zeros = quantize_weight(w, scheme)
    x = torch.randn(2, 40, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = dense_matmul_cpu(x, codes, scales, zeros, scheme, rows=64)
    want = quant_matmul_reference(x, codes, scales, zeros, scheme)
    assert got.shape == (2, 40, 200) and got.dtype == dtype and got.is_contiguous()
    tolerance("quant_matmul_cpu", dtype).assert_close(got, want, what=f"{_ids(scheme)} {dtype}")


def test_custom_op_traces_under_torch_compile():
    scheme = QuantScheme(kind="int4", group_size=32, symmetric=False)
    codes, scales, zeros = quantize_weight(_weight(16, 64, seed=8), scheme)
    x = torch.randn(2, 64)

    def f(x):
        return quant_matmul(x, codes, scales, zeros, scheme) * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x))
    torch.library.opcheck(torch.ops.plait.quant_matmul.default,
                          (x, codes, scales, zeros, "int4", 32, False, None), test_utils=("test_faketensor",))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "int3"}, "kind='int3'"),
        ({"kind": "int4", "group_size": 48}, "group_size=48"),
        ({"kind": "int4"}, "group_size=None"),
        ({"kind": "int8", "group_size": 64}, "leave group_size=None"),
        ({"kind": "fp6", "symmetric": False}, "only int4 has zero points"),
    ],
)
def test_scheme_refuses_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantScheme(**kwargs)


def test_bad_weights_and_inputs_are_refused_with_the_field():
    int4 = QuantScheme(kind="int4", group_size=64)
    with pytest.raises(ValueError, match="in_features=96 is not divisible by group_size=64"):
        quantize_weight(torch.randn(8, 96), int4)
    with pytest.raises(ValueError, match="weight.dtype=torch.int32"):
        quantize_weight(torch.ones(8, 64, dtype=torch.int32), int4)
    bad = torch.randn(8, 64)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_weight(bad, int4)
    codes, scales, zeros = quantize_weight(torch.randn(8, 64), int4)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=128"):
        quant_matmul(torch.randn(2, 128), codes, scales, zeros, int4)
    with pytest.raises(ValueError, match="x.dtype=torch.float64"):
        quant_matmul(torch.randn(2, 64, dtype=torch.float64), codes, scales, zeros, int4)
    with pytest.raises(ValueError, match="zeros must be given exactly for asymmetric int4"):
        quant_matmul(torch.randn(2, 64), codes, scales, torch.zeros(8, 1, dtype=torch.uint8), int4)


def test_scheme_json_round_trip_and_refusal():
    for scheme in SCHEMES:
        assert QuantScheme.from_json(scheme.to_json()) == scheme
    with pytest.raises(ValueError, match="must be a dict with kind, group_size, symmetric"):
        QuantScheme.from_json({"kind": "int8"})


# ---- plait's own AVX2 CPU kernels (quant_matmul_cpu): compiled once per machine, then cached.
def _avx2():
    import importlib

    module = importlib.import_module("plait.kernels.ops.quant_matmul_cpu")
    if not module.cpu_supported():
        pytest.skip("no AVX2 on this CPU: plait's CPU kernels do not apply (torch's kernels are the fallback)")
    assert module.available(), module.build_error  # a compiler is part of the test environment
    return module


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.kind != "fp6"], ids=_ids)
def test_avx2_kernels_match_reference_and_dequantize_bitwise(scheme):
    cpu = _avx2()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(70, 256, generator=gen)  # 70 rows: full 4- and 2-row tiles plus a remainder
    codes, scales, zeros = quantize_weight(w, scheme)
    # every register tile shape (AVX2: 1-4 input rows; AVX-512: 1-8) and more than one tile, on
    # every instruction set this CPU runs
    for rows in (1, 2, 3, 5, 8, 9, 13):
        x = torch.randn(2, rows, 256, generator=gen)
        want = quant_matmul_reference(x, codes, scales, zeros, scheme)
        for isa in cpu.isas():
            tolerance("quant_matmul_avx2", torch.float32).assert_close(
                cpu.gemv(x, codes, scales, zeros, scheme.group_size, isa=isa), want,
                what=f"{_ids(scheme)} rows={rows} {isa}")
    out = torch.empty(20, 256)
    cpu.dequantize_rows(codes, scales, zeros, scheme.group_size, 40, 60, out)
    assert torch.equal(out, dequantize_weight(codes[40:60], scales[40:60], None if zeros is None else zeros[40:60],
                                              scheme))
    x = torch.randn(40, 256, generator=gen)
    assert torch.equal(dense_matmul_cpu(x, codes, scales, zeros, scheme, own_kernel=True),
                       dense_matmul_cpu(x, codes, scales, zeros, scheme))


def test_avx2_kernels_exact_where_every_sum_is_exact():
    """Small-integer activations and power-of-two scales: every product and sum is exact in fp32,
    so the kernels' other summation order must give the reference's result bit for bit."""
    cpu = _avx2()
    gen = torch.Generator().manual_seed(4)
    for scheme in (QuantScheme(kind="int8"), QuantScheme(kind="int4", group_size=32, symmetric=False)):
        codes, scales, zeros = quantize_weight(torch.randn(36, 64, generator=gen), scheme)
        scales = torch.full_like(scales, 0.25)
        x = torch.randint(-3, 4, (5, 64), generator=gen).float()
        for isa in cpu.isas():
            assert torch.equal(cpu.gemv(x, codes, scales, zeros, scheme.group_size, isa=isa),
                               quant_matmul_reference(x, codes, scales, zeros, scheme)), isa


def test_avx2_kernels_refuse_what_they_cannot_take():
    cpu = _avx2()
    codes, scales, _ = quantize_weight(torch.randn(8, 40), QuantScheme(kind="int8"))
    with pytest.raises(ValueError, match="K % 16 == 0"):  # K = 40 is not a multiple of 16
        cpu.gemv(torch.randn(1, 40), codes, scales, None, None)
    codes, scales, _ = quantize_weight(torch.randn(8, 64), QuantScheme(kind="int8"))
    with pytest.raises(ValueError, match="x must be float32"):
        cpu.gemv(torch.randn(1, 64, dtype=torch.bfloat16), codes, scales, None, None)
    with pytest.raises(ValueError, match=r"isa='sse' cannot run here; use one of avx2"):
        cpu.gemv(torch.randn(1, 64), codes, scales, None, None, isa="sse")
    assert cpu.isas()[0] == "avx2" and set(cpu.isas()) <= set(cpu.ISAS)
    with pytest.raises(ValueError, match=r"rows \[4, 12\)"):
        cpu.dequantize_rows(codes, scales, None, None, 4, 12, torch.empty(8, 64))
    assert cpu.library_path().exists() and cpu.build_seconds is not None
