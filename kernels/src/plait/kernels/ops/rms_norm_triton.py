"""Triton RMSNorm (with the optional fused residual add): kernels, launchers, autograd Function.

Grid, recompute and constants - read this before changing anything below.

Forward: grid ``(rows,)``, one program per row. ``BLOCK_N = next_power_of_2(N)`` so a whole row sits
in registers: it is read once (x, plus the residual when fused), the sum of squares is reduced in
fp32, and the output is written once. With a residual the program also writes ``h = x + residual``
(rounded to the input dtype, exactly as torch's ``x + residual`` rounds) because the caller needs
the new residual stream anyway. Each program saves ``rstd`` for its row: 4 bytes per row instead
of the N-wide normalised row, so backward stores nothing else.

Backward: grid ``(G,)`` with ``G = min(rows, programs)``; program ``p`` takes rows ``p, p+G, ...``.
It re-reads the forward's input ``h`` (x itself, or the ``h`` the forward already wrote) and the
saved ``rstd``, and recomputes the normalised row ``n = h * rstd``: one extra read of h is cheaper
than writing and re-reading n. Per row it writes ``dh = rstd * (dn - n * mean(dn * n))`` with
``dn = dy * (offset + w)``, plus the incoming gradient of the returned residual stream when fused;
``dh`` is the gradient of both x and the residual, since ``h = x + residual``. ``dw = sum_rows dy * n``
is accumulated per program in an fp32 register vector and written to a ``[G, N]`` fp32 partial
buffer that the launcher sums. Partials instead of atomics keep dw deterministic (run to run
bitwise equal) and free of contention on the N addresses.

Constants:
* ``MAX_FUSED_N = 65536``: at 32 warps that is 64 fp32 values per thread, about the most a thread
  holds without spilling; wider rows go to the reference (see ``rms_norm.rms_norm``).
* ``num_warps`` grows with BLOCK_N (4 up to 1024, 8 up to 4096, 16 up to 16384, else 32) so each
  thread keeps 8-64 elements: enough bytes in flight per thread for bandwidth, few enough registers.
* Backward programs: 2 per SM on CUDA, so one program's loads overlap another's arithmetic while the
  partial buffer (G x N x 4 bytes) stays small next to the dx traffic; under the CPU interpreter,
  where programs run one after another, 4 programs are enough to exercise the partial-sum path.
  (Untuned: this module was written without a GPU; retune with the kernels benchmark on one.)
* Row offsets are computed in int64 so tensors above 2^31 elements index correctly.

CPU interpreter (``TRITON_INTERPRET=1``, how the tests run without a GPU): it must be set before the
process imports triton (triton jits its own library at import; ``_check_mode`` says so otherwise), and
its fp32->bf16 cast truncates, so under it bf16 outputs are rounded to nearest even in integer
arithmetic (``SOFT_BF16``) to give the bits the GPU gives. Compiled GPU code never takes that branch.

Triton is imported here and only here, so ``plait.kernels`` imports on machines without Triton.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from plait.kernels.dispatch import check_triton_launch_mode

MAX_FUSED_N = 65536
_INTERPRETER_BWD_PROGRAMS = 4
_BWD_PROGRAMS_PER_SM = 2


@triton.jit
def _cast_out(v, OUT_DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):  # noqa: N803 - Triton style
    # Cast fp32 -> the output dtype. SOFT_BF16 (set only under the CPU interpreter, whose
    # fp32->bf16 cast truncates) rounds to nearest even in integer arithmetic instead, so the
    # interpreter produces the bits a GPU's cvt.rn.bf16.f32 and torch produce.
    if SOFT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(v != v, 0x7FC00000, bits)  # any NaN -> the quiet NaN, never inf
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(OUT_DTYPE)
    return out


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    stride_x, stride_r, stride_y, stride_h,
    N, eps, offset,  # noqa: N803
    HAS_RESIDUAL: tl.constexpr, SOFT_BF16: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: N803
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        # Add in fp32 and round once to the input dtype: the same bits as torch's x + residual.
        x = _cast_out(x.to(tl.float32) + r.to(tl.float32), X.dtype.element_ty, SOFT_BF16)
        tl.store(H + row * stride_h + cols, x, mask=mask)
    h = x.to(tl.float32)
    # Padding lanes load 0, so they add nothing to the sum; divide by the true N.
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = h * rstd * (w + offset)
    tl.store(Y + row * stride_y + cols, _cast_out(y, Y.dtype.element_ty, SOFT_BF16), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, DH_OUT, H, W, RSTD, DX, DW_PARTIAL,  # noqa: N803 - Triton convention, as above
    stride_dy, stride_dho, stride_h, stride_dx,
    M, N, offset,  # noqa: N803
    HAS_DH_OUT: tl.constexpr, COMPUTE_DW: tl.constexpr,  # noqa: N803
    SOFT_BF16: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: N803
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row = pid.to(tl.int64)
    for _ in range(pid, M, programs):
        rstd = tl.load(RSTD + row)
        h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        n = h * rstd
        if COMPUTE_DW:
            dw_acc += dy * n
        dn = dy * w
        dh = rstd * (dn - n * (tl.sum(dn * n, axis=0) / N))
        if HAS_DH_OUT:
            dh += tl.load(DH_OUT + row * stride_dho + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, _cast_out(dh, DX.dtype.element_ty, SOFT_BF16), mask=mask)
        row += programs
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_acc, mask=mask)


def _check_mode(t: torch.Tensor) -> bool:
    """Refuse a launch the imported kernels cannot run; returns whether to round bf16 in software
    (the interpreter truncates fp32 -> bf16 casts where CUDA rounds to nearest even)."""
    interpreted = check_triton_launch_mode(_rms_norm_fwd_kernel, t, op="RMSNorm")
    return interpreted and t.dtype == torch.bfloat16


def supports_hidden_size(n: int) -> bool:
    """Whether a row of ``n`` elements fits one program (``n <= MAX_FUSED_N``)."""
    return 1 <= n <= MAX_FUSED_N


def _num_warps(block_n: int) -> int:
    if block_n <= 1024:
        return 4
    if block_n <= 4096:
        return 8
    if block_n <= 16384:
        return 16
    return 32


@functools.cache
def _cuda_bwd_programs(device_index: int) -> int:
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return _BWD_PROGRAMS_PER_SM * sms


def _bwd_programs(device: torch.device, rows: int) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = _cuda_bwd_programs(index)
    else:
        limit = _INTERPRETER_BWD_PROGRAMS
    return max(1, min(rows, limit))


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as ``[rows, N]`` with a unit last stride, copying only when that is impossible."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device; make it the tensor's device for the launch.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch the forward kernel (inputs already validated by ``rms_norm``).

    Args:
        x: input of any leading shape, hidden size last.
        weight: ``[N]`` scale.
        eps: added to the mean square.
        offset: added to the weight (1.0 for Gemma).
        residual: optional tensor of x's shape and dtype, added to x first.

    Returns:
        ``(y, h, rstd)``: y of x's shape and dtype (contiguous); h = x + residual (``None``
        without a residual); rstd, fp32 ``[rows]``.
    """
    n = x.shape[-1]
    x2 = _as_rows(x)
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, h, rstd
    r2 = _as_rows(residual) if residual is not None else x2
    h2 = h.view(rows, n) if h is not None else x2
    y2 = y.view(rows, n)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    block_n = triton.next_power_of_2(n)
    soft_bf16 = _check_mode(x)
    with _device_guard(x):
        _rms_norm_fwd_kernel[(rows,)](
            x2, r2, w, y2, h2, rstd,
            x2.stride(0), r2.stride(0), y2.stride(0), h2.stride(0),
            n, float(eps), float(offset),
            HAS_RESIDUAL=residual is not None, SOFT_BF16=soft_bf16,
            BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )
    return y, h, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    dh_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    *,
    compute_dw: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel.

    Args:
        dy: gradient of y (x's shape; any strides).
        dh_out: gradient of the returned residual stream h, or ``None`` when it has none.
        h: the forward's normalised input (x, or x + residual).
        weight: ``[N]`` scale.
        rstd: fp32 ``[rows]`` saved by the forward.
        offset: the forward's weight offset.
        compute_dw: skip the weight gradient when weight does not need one.

    Returns:
        ``(dh, dw)``: dh of h's shape and dtype (the gradient of x, and of the residual when
        fused); dw in weight's dtype, or ``None`` when ``compute_dw`` is false.
    """
    n = h.shape[-1]
    h2 = _as_rows(h)
    rows = h2.shape[0]
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if rows == 0:
        return dx, torch.zeros_like(weight) if compute_dw else None
    dy2 = _as_rows(dy)
    dho2 = _as_rows(dh_out) if dh_out is not None else dy2
    dx2 = dx.view(rows, n)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    programs = _bwd_programs(h.device, rows)
    partial = torch.empty((programs, n) if compute_dw else (1,), dtype=torch.float32, device=h.device)
    block_n = triton.next_power_of_2(n)
    soft_bf16 = _check_mode(h)
    with _device_guard(h):
        _rms_norm_bwd_kernel[(programs,)](
            dy2, dho2, h2, w, rstd, dx2, partial,
            dy2.stride(0), dho2.stride(0), h2.stride(0), dx2.stride(0),
            rows, n, float(offset),
            HAS_DH_OUT=dh_out is not None, COMPUTE_DW=compute_dw, SOFT_BF16=soft_bf16,
            BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )
    dw = partial.sum(dim=0).to(weight.dtype) if compute_dw else None
    return dx, dw


class RMSNormTritonFunction(torch.autograd.Function):
    """Autograd wrapper: ``apply(x, weight, residual, eps, offset)``.

    Returns ``y`` without a residual and ``(y, h)`` with one; gradients flow to x, weight and
    residual. Outputs are fresh tensors of x's shape (not views), so callers may update the
    returned residual stream in place.
    """

    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset):
        y, h, rstd = rms_norm_forward(x, weight, eps, offset, residual)
        # Without a residual the normalised input is x itself: save it (a view, no copy) and
        # re-read it in backward. With one, save the h this kernel wrote anyway.
        ctx.save_for_backward(x if h is None else h, weight, rstd)
        ctx.offset = offset
        ctx.has_residual = residual is not None
        ctx.set_materialize_grads(False)
        if h is None:
            return y
        return y, h

    @staticmethod
    def backward(ctx, *grads):
        h, weight, rstd = ctx.saved_tensors
        dy = grads[0]
        dh_out = grads[1] if ctx.has_residual else None
        if dy is None:
            # Only the returned residual stream reached the loss: y contributes nothing, and
            # h = x + residual passes its gradient straight to both. No launch needed.
            need_x, _, need_r = ctx.needs_input_grad[:3]
            return dh_out if need_x else None, None, dh_out if need_r else None, None, None
        dx, dw = rms_norm_backward(
            dy, dh_out, h, weight, rstd, ctx.offset, compute_dw=ctx.needs_input_grad[1]
        )
        dres = dx if ctx.has_residual and ctx.needs_input_grad[2] else None
        return dx if ctx.needs_input_grad[0] else None, dw, dres, None, None


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run RMSNorm on the Triton path (called by ``plait.kernels.ops.rms_norm`` after validation).

    Args:
        x: input, hidden size last.
        weight: ``[N]`` scale.
        eps: added to the mean square.
        residual: optional residual to add first.
        offset: added to the weight.

    Returns:
        ``y``, or ``(y, x + residual)`` with a residual.
    """
    return RMSNormTritonFunction.apply(x, weight, residual, eps, offset)
