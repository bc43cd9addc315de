"""Triton kernels for ``silu_and_mul`` / ``gelu_and_mul``, forward and backward.

Grid: ``(rows, cdiv(d, BLOCK))``. The input is viewed as ``[rows, 2d]`` (leading dims
flattened, last dim unit-stride, any row stride); each program handles ``BLOCK`` columns of one
row: it loads the matching gate and up slices, computes in fp32 and stores ``[rows, d]``.
Nothing is reduced, so programs are independent and the kernel is purely bandwidth-bound.

Recomputed: the backward saves only the input ``x`` (the ``[rows, 2d]`` tensor the GEMM wrote
anyway) and recomputes the activation and its derivative from the gate, rather than saving
``act(gate)``: that costs a few flops per element and saves ``rows*d`` elements of memory.

Constants: ``BLOCK`` is ``min(next_pow2(d), 1024)``; 1024 fp32 elements per program over 4
warps is 8 per thread, enough for vectorised loads without spilling, and small ``d`` does not
waste lanes. Only primitive ops (``tl.exp``, ``tl.erf``) are used: ``tl.sigmoid`` is itself a
``@jit`` library function, which the CPU interpreter cannot call when Triton was imported before
``TRITON_INTERPRET=1`` was set. So ``sigmoid(g) = 1/(1+exp(-g))`` (0 or 1 at the extremes, no NaN),
and, as there is no tanh either, ``tanh(z) = 2*sigmoid(2z) - 1``, exact in real arithmetic.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from plait.kernels import dispatch, settings

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_MAX_BLOCK = 1024
_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/sqrt(2), erf-GELU argument scale
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi), the normal density's constant
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # tanh-GELU's inner scale
_GELU_CUBIC = tl.constexpr(0.044715)  # tanh-GELU's cubic coefficient


def _gated_kernel(x_ptr, dy_ptr, out_ptr, x_row_stride, dy_row_stride, out_row_stride, d,
                  ACT: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    # One body for both passes so the activation and its derivative are written once. Forward:
    # out[row, :d] = act(g) * u. Backward: out is dx, out[row, :d] = dy*u*act'(g), out[row, d:] = dy*act(g).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        s = 1.0 / (1.0 + tl.exp(-g))
        act = g * s
        dact = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * _SQRT1_2))
        act = g * cdf
        dact = cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    else:
        inner = _SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        act = 0.5 * g * (1.0 + t)
        dact = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    out_row = out_ptr + row * out_row_stride
    if BACKWARD:
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (dy * u * dact).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + d + cols, (dy * act).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_row + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jitted(interpret: bool):
    # triton.jit reads TRITON_INTERPRET when applied; applying it per mode (as rms_norm_triton does)
    # lets one process switch modes and keeps an early import from pinning the wrong one.
    del interpret  # only the cache key
    return triton.jit(_gated_kernel)


def _device_guard(t: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tensor's device for the launch.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as ``[rows, width]`` with a unit-stride last dim (copying only if it must)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _block(d: int) -> int:
    return min(triton.next_power_of_2(max(d, 1)), _MAX_BLOCK)


def _check_device(x: torch.Tensor) -> None:
    if not dispatch.triton_device_ok(x):
        raise ValueError(
            "gated activation Triton path needs a CUDA tensor or TRITON_INTERPRET=1; "
            "use PLAIT_KERNEL_BACKEND=auto to fall back to the reference."
        )


def gated_forward(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Launch the forward kernel.

    Args:
        x: ``[..., 2d]``, gate first; validated by the caller.
        activation: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``.

    Returns:
        A new contiguous ``[..., d]`` tensor of ``x.dtype``.

    Raises:
        ValueError: ``x`` is on a device Triton cannot run on here.
    """
    _check_device(x)
    d = x.shape[-1] // 2
    rows = _as_rows(x)
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if out.numel():
        block = _block(d)
        grid = (rows.shape[0], triton.cdiv(d, block))
        with _device_guard(x):
            _jitted(settings.triton_interpret())[grid](
                rows, rows, out, rows.stride(0), 0, out.stride(0), d,
                ACT=_ACTIVATION_CODES[activation], BACKWARD=False, BLOCK=block,
            )
    return out.view(*x.shape[:-1], d)


def gated_backward(x: torch.Tensor, grad_out: torch.Tensor, activation: str) -> torch.Tensor:
    """Launch the backward kernel: ``dx = [dy * up * act'(gate), dy * act(gate)]``.

    Args:
        x: the forward's ``[..., 2d]`` input.
        grad_out: ``[..., d]``, the gradient of the output.
        activation: as in :func:`gated_forward`.

    Returns:
        ``dx`` of ``x``'s shape, contiguous, in ``x.dtype``.
    """
    d = x.shape[-1] // 2
    rows = _as_rows(x)
    dy = _as_rows(grad_out.to(x.dtype))
    dx = torch.empty((rows.shape[0], 2 * d), dtype=x.dtype, device=x.device)
    if dx.numel():
        block = _block(d)
        grid = (rows.shape[0], triton.cdiv(d, block))
        with _device_guard(x):
            _jitted(settings.triton_interpret())[grid](
                rows, dy, dx, rows.stride(0), dy.stride(0), dx.stride(0), d,
                ACT=_ACTIVATION_CODES[activation], BACKWARD=True, BLOCK=block,
            )
    return dx.view(x.shape)


class GatedActivationFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (recomputing the activation from ``x``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.activation = activation
        ctx.save_for_backward(x)
        return gated_forward(x, activation)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        return gated_backward(x, grad_out, ctx.activation), None


def gated_activation_triton(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Triton path of :func:`plait.kernels.ops.gated_activation.silu_and_mul` / ``gelu_and_mul``.

    Args:
        x: ``[..., 2d]``, validated by the public function.
        activation: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``.

    Returns:
        ``[..., d]`` in ``x.dtype``; differentiable.
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return GatedActivationFunction.apply(x, activation)
    return gated_forward(x, activation)
