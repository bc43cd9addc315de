"""RMSNorm: the Triton path against the torch reference, the reference against float64, errors.

The Triton path runs on CUDA when this machine has a GPU, and otherwise under the Triton CPU
interpreter (``TRITON_INTERPRET=1`` with ``PLAIT_KERNEL_BACKEND=triton``). Tolerances come from
``plait.kernels.tolerances``; shapes are small and odd so masking and the backward's row loop
(fewer programs than rows) are exercised.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from plait.kernels.ops import RMSNorm, rms_norm, rms_norm_reference
from plait.kernels.tolerances import tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HIDDEN = (1, 7, 33, 130, 1000)
ROWS = (1, 3, 17)
ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"




def _inputs(shape, dtype, *, residual: bool, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(device=device, dtype=dtype).requires_grad_()
    r = torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    return x, w, (r if residual else None)


def _run(fn, x, w, r, *, offset: float, grads_seed: int = 1):
    """Forward and backward of ``fn``; returns (outputs, grads of x, w[, r])."""
    out = fn(x, w, 1e-6, residual=r, offset=offset)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(grads_seed)
    upstream = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
    inputs = [x, w] if r is None else [x, w, r]
    return outs, torch.autograd.grad(outs, inputs, upstream)


def _compare(shape, dtype, residual, offset, device, *, what=""):
    x, w, r = _inputs(shape, dtype, residual=residual, device=device)
    outs, grads = _run(rms_norm, x, w, r, offset=offset)
    ref_outs, ref_grads = _run(rms_norm_reference, x, w, r, offset=offset)
    label = f"{what}{tuple(shape)} {dtype} residual={residual} offset={offset}"
    fwd, bwd = tolerance("rms_norm_fwd", dtype), tolerance("rms_norm_bwd", dtype)
    for name, got, want in zip(("y", "h"), outs, ref_outs):
        fwd.assert_close(got, want, what=f"{name} {label}")
    for name, got, want in zip(("dx", "dweight", "dresidual"), grads, ref_grads):
        bwd.assert_close(got, want, what=f"{name} {label}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("residual,offset", [(False, 0.0), (True, 0.0), (False, 1.0), (True, 1.0)])
def test_triton_matches_reference(triton_backend, dtype, hidden, rows, residual, offset):
    _compare((rows, hidden), dtype, residual, offset, triton_backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_triton_leading_batch_dims(triton_backend, dtype):
    _compare((2, 3, 5, 33), dtype, True, 0.0, triton_backend)
    _compare((4, 1, 130), dtype, False, 1.0, triton_backend)


def _noncontiguous_cases(device, dtype):
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return {
        # last dim strided: the launcher must copy
        "transposed": lambda: rand(33, 6).t(),
        # rows strided, last dim contiguous: a view with row stride 2*33, no copy
        "row-sliced": lambda: rand(10, 33)[::2],
        # a narrower window of wider rows: row stride 40
        "col-sliced": lambda: rand(5, 40)[:, 3:36],
        # leading dims permuted, last dim contiguous
        "permuted": lambda: rand(3, 4, 33).transpose(0, 1),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", ["transposed", "row-sliced", "col-sliced", "permuted"])
def test_triton_noncontiguous_inputs(triton_backend, dtype, case):
    make = _noncontiguous_cases(triton_backend, dtype)[case]
    x, r = make().requires_grad_(), make().requires_grad_()
    w = torch.linspace(0.5, 1.5, 66, device=triton_backend, dtype=dtype)[::2].requires_grad_()
    assert not w.is_contiguous()
    ref = rms_norm_reference
    fwd, bwd = tolerance("rms_norm_fwd", dtype), tolerance("rms_norm_bwd", dtype)
    for residual in (None, r):
        outs, grads = _run(rms_norm, x, w, residual, offset=0.0)
        ref_outs, ref_grads = _run(ref, x, w, residual, offset=0.0)
        for got, want in zip(outs, ref_outs):
            assert got.shape == x.shape
            fwd.assert_close(got, want, what=f"{case} fwd {dtype}")
        for got, want in zip(grads, ref_grads):
            bwd.assert_close(got, want, what=f"{case} bwd {dtype}")


def test_triton_noncontiguous_upstream_gradient(triton_backend):
    x, w, r = _inputs((6, 33), torch.float32, residual=True, device=triton_backend)
    dy = torch.randn(33, 6, device=triton_backend).t()
    dh = torch.randn(6, 66, device=triton_backend)[:, ::2]
    got = torch.autograd.grad(rms_norm(x, w, residual=r), [x, w, r], [dy, dh])
    want = torch.autograd.grad(rms_norm_reference(x, w, residual=r), [x, w, r], [dy, dh])
    for a, b in zip(got, want):
        tolerance("rms_norm_bwd", torch.float32).assert_close(a, b, what="strided upstream grads")


def test_triton_mixed_weight_dtype(triton_backend):
    x, _, r = _inputs((5, 130), torch.bfloat16, residual=True, device=triton_backend)
    w = torch.rand(130, device=triton_backend, dtype=torch.float32).requires_grad_()
    outs, grads = _run(rms_norm, x, w, r, offset=0.0)
    ref_outs, ref_grads = _run(rms_norm_reference, x, w, r, offset=0.0)
    assert outs[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    for got, want in zip(outs, ref_outs):
        tolerance("rms_norm_fwd", torch.bfloat16).assert_close(got, want, what="mixed fwd")
    for got, want in zip(grads, ref_grads):
        tolerance("rms_norm_bwd", torch.bfloat16).assert_close(got, want, what="mixed bwd")


def test_triton_only_one_output_used(triton_backend):
    """Gradients are right when only y, or only the residual stream h, reaches the loss."""
    x, w, r = _inputs((3, 33), torch.float32, residual=True, device=triton_backend)
    ref = rms_norm_reference
    tol = tolerance("rms_norm_bwd", torch.float32)
    for pick in (0, 1):
        got = torch.autograd.grad(rms_norm(x, w, residual=r)[pick].pow(2).sum(), [x, w, r], allow_unused=True)
        want = torch.autograd.grad(ref(x, w, residual=r)[pick].pow(2).sum(), [x, w, r], allow_unused=True)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                tol.assert_close(a, b, what=f"only output {pick} used")


def test_triton_weight_frozen_and_backward_deterministic(triton_backend):
    x, w, _ = _inputs((17, 130), torch.float32, residual=False, device=triton_backend)
    w.requires_grad_(False)
    (dx,) = torch.autograd.grad(rms_norm(x, w).sum(), [x])
    assert dx.shape == x.shape
    w.requires_grad_(True)
    first = torch.autograd.grad(rms_norm(x, w).pow(2).sum(), [x, w])
    second = torch.autograd.grad(rms_norm(x, w).pow(2).sum(), [x, w])
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "partial-buffer dw must be deterministic"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_triton_residual_stream_is_torch_sum(triton_backend, dtype):
    """h has the bits of torch's x + residual (bf16 too: round to nearest even, also when interpreted)."""
    x, w, r = _inputs((3, 130), dtype, residual=True, device=triton_backend)
    with torch.no_grad():
        _, h = rms_norm(x, w, residual=r)
        assert torch.equal(h, x + r)
        h.add_(1.0)  # a fresh tensor, not a view made inside the autograd Function: in place is fine


def test_triton_empty_rows(triton_backend):
    x = torch.empty(0, 33, device=triton_backend, requires_grad=True)
    w = torch.ones(33, device=triton_backend, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (0, 33)
    dx, dw = torch.autograd.grad(y.sum(), [x, w])
    assert dx.shape == (0, 33) and torch.equal(dw, torch.zeros_like(w))


def test_triton_too_wide_rows_use_reference(triton_backend):
    from plait.kernels.ops import rms_norm_triton

    n = rms_norm_triton.MAX_FUSED_N + 1
    x = torch.randn(2, n, device=triton_backend)
    w = torch.rand(n, device=triton_backend)
    assert torch.equal(rms_norm(x, w), rms_norm_reference(x, w))


# ---------------------------------------------------------------- reference and dispatch (no Triton)


def _float64_formula(x, w, eps, residual, offset):
    h = x.double() if residual is None else (x + residual).double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("residual", [False, True])
def test_reference_matches_float64_formula(dtype, residual):
    x, w, r = _inputs((17, 130), dtype, residual=residual, device="cpu")
    got = rms_norm_reference(x, w, 1e-5, residual=r, offset=0.5)
    y = got[0] if residual else got
    want = _float64_formula(x, w, 1e-5, r, 0.5)
    tolerance("rms_norm_fwd", dtype).assert_close(y, want.to(dtype), what="reference vs float64")
    gy = torch.randn(want.shape).to(dtype)  # rounded once, then shared by both sides
    inputs = [x, w] + ([r] if residual else [])
    got_grads = torch.autograd.grad(y, inputs, gy)
    want_grads = torch.autograd.grad(want, inputs, gy.double())
    for a, b in zip(got_grads, want_grads):
        tolerance("rms_norm_bwd", dtype).assert_close(a, b.to(dtype), what="reference grads vs float64")


def test_auto_backend_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.delenv("PLAIT_KERNEL_BACKEND", raising=False)
    x, w, r = _inputs((3, 7, 33), torch.bfloat16, residual=True, device="cpu")
    y, h = rms_norm(x, w, residual=r, offset=1.0)
    ref_y, ref_h = rms_norm_reference(x, w, residual=r, offset=1.0)
    assert torch.equal(y, ref_y) and torch.equal(h, ref_h)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


def test_forcing_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    if not importlib.util.find_spec("triton") is not None:
        pytest.importorskip("triton")
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 8), torch.ones(8))


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "cudnn-magic")
    with pytest.raises(ValueError, match="cudnn-magic"):
        rms_norm(torch.randn(2, 8), torch.ones(8))


@pytest.mark.parametrize("make,match", [
    (lambda: (torch.randn(2, 8, dtype=torch.float64), torch.ones(8), {}), "x.dtype"),
    (lambda: (torch.randint(0, 3, (2, 8)), torch.ones(8), {}), "x.dtype"),
    (lambda: (torch.randn(2, 8), torch.ones(8, dtype=torch.int32), {}), "weight.dtype"),
    (lambda: (torch.randn(2, 8), torch.ones(7), {}), "weight.shape"),
    (lambda: (torch.randn(2, 8), torch.ones(1, 8), {}), "weight.shape"),
    (lambda: (torch.randn(2, 0), torch.ones(0), {}), "hidden dimension"),
    (lambda: (torch.randn(2, 8), torch.ones(8), {"residual": torch.randn(3, 8)}), "residual.shape"),
    (lambda: (torch.randn(2, 8), torch.ones(8), {"residual": torch.randn(2, 8).half()}), "residual.dtype"),
    (lambda: (torch.randn(2, 8), torch.ones(8), {"eps": -1e-6}), "eps"),
    (lambda: (torch.randn(2, 8), torch.ones(8), {"eps": float("nan")}), "eps"),
    (lambda: (torch.randn(2, 8), torch.ones(8), {"offset": float("inf")}), "offset"),
])
def test_bad_inputs_are_refused_with_the_argument_named(make, match):
    x, w, kwargs = make()
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, **kwargs)


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm([1.0, 2.0], torch.ones(2))


def test_module_initialises_to_unit_scale_and_matches_function():
    for offset in (0.0, 1.0):
        layer = RMSNorm(33, eps=1e-5, offset=offset)
        assert torch.all(layer.weight + offset == 1.0)
        x, r = torch.randn(2, 4, 33), torch.randn(2, 4, 33)
        assert torch.equal(layer(x), rms_norm(x, layer.weight, 1e-5, offset=offset))
        y, h = layer(x, r)
        assert torch.equal(h, x + r) and torch.equal(y, rms_norm(x + r, layer.weight, 1e-5, offset=offset))
    assert "33, eps=1e-05, offset=1" in repr(layer)


@pytest.mark.parametrize("kwargs,match", [
    ({"hidden_size": 0}, "hidden_size"), ({"hidden_size": 8, "eps": -1.0}, "eps"),
    ({"hidden_size": 8, "offset": float("nan")}, "offset"),
])
def test_module_validates_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RMSNorm(**kwargs)


# ---------------------------------------------------------------- benchmark smoke test


def test_benchmark_case_produces_every_row_on_cpu():
    from plait.kernels.benchmarks.rms_norm_bench import Case, bench_case

    case = Case(rows=8, hidden=16, dtype=torch.float32, residual=True)
    assert case.ideal_bytes(backward=False) == 8 * 16 * 4 * 4
    rows = bench_case(case, quick=True, device=torch.device("cpu"), steps=1, reps=1)
    peers = ["eager torch", "torch.compile", "Liger-Kernel", "clone() copy GB/s"]
    assert [row.peer for row in rows[:4]] == peers
    assert len(rows) == 8 and {row.benchmark for row in rows} == {
        "fused_add_rms_norm fwd 8x16 fp32", "fused_add_rms_norm fwd+bwd 8x16 fp32"}
    assert rows[0].ratio is not None and rows[0].ours > 0
    assert "skipped in --quick" in rows[1].note and rows[2].note
    assert rows[3].ours > 0 and "matches float64" in rows[3].note
    with pytest.raises(ValueError, match="rows"):
        Case(rows=0, hidden=16, dtype=torch.float32)
