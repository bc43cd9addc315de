"""RMSNorm as ``torch.library`` custom ops, for torch.compile.

``plait::rms_norm`` and ``plait::fused_add_rms_norm`` (the residual form, returning ``(y, h)``)
have shape-only fakes, so the compiler keeps each as one opaque call, and one registered backward,
``plait::rms_norm_backward``. On the CPU path that backward runs the steps eager autograd runs
for :func:`~plait.kernels.ops.rms_norm.rms_norm_reference`, in the same order, so compiled
gradients are eager's bit for bit; on the Triton path it re-runs the forward kernel for ``rstd``
(the op keeps no intermediates) and then the Triton backward.
"""

from __future__ import annotations

import torch

from plait.kernels.ops.rms_norm import rms_norm_reference


def _supports(x: torch.Tensor) -> bool:
    from plait.kernels.ops import rms_norm_triton

    return rms_norm_triton.supports_hidden_size(x.shape[-1])


@torch.library.custom_op("plait::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 use_triton: bool) -> torch.Tensor:
    if use_triton and _supports(x):
        from plait.kernels.ops.rms_norm_triton import rms_norm_forward

        return rms_norm_forward(x, weight, eps, offset, None)[0].contiguous()
    return rms_norm_reference(x, weight, eps, offset=offset).contiguous()  # the fake's strides


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, offset, use_triton):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("plait::fused_add_rms_norm", mutates_args=())
def _fused_add_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                  use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton and _supports(x):
        from plait.kernels.ops.rms_norm_triton import rms_norm_forward

        y, h, _ = rms_norm_forward(x, weight, eps, offset, residual)
    else:
        y, h = rms_norm_reference(x, weight, eps, residual=residual, offset=offset)
    return y.contiguous(), h.contiguous()


@_fused_add_op.register_fake
def _fused_add_fake(x, residual, weight, eps, offset, use_triton):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _reference_backward(grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor,
                        eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd's steps for the reference, op by op (``sum_to_size`` as autograd reduces broadcasts)."""
    compute = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(compute)
    rstd = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.to(compute) + offset
    g = grad_y.to(compute)
    d_w = (g * (hf * rstd)).sum_to_size(w.shape).to(weight.dtype)
    d_scaled = g * w
    d_direct = d_scaled * rstd
    d_rstd = (d_scaled * hf).sum_to_size(rstd.shape)
    d_square = (-0.5 * d_rstd * rstd.pow(3)).expand(hf.shape) / hf.shape[-1]
    d_via_mean = d_square * (2 * hf)
    if grad_h is not None and h.dtype == compute:
        # h feeds the returned h and (uncast) both products: the engine adds in this order.
        return (grad_h + d_direct) + d_via_mean, d_w
    d_h = (d_direct + d_via_mean).to(h.dtype)
    return (d_h if grad_h is None else d_h + grad_h), d_w


@torch.library.custom_op("plait::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor,
                          weight: torch.Tensor, eps: float, offset: float,
                          use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton and _supports(h):
        from plait.kernels.ops.rms_norm_triton import rms_norm_backward, rms_norm_forward

        rstd = rms_norm_forward(h, weight, eps, offset, None)[2]
        return rms_norm_backward(grad_y, grad_h, h, weight, rstd, offset)
    return _reference_backward(grad_y, grad_h, h, weight, eps, offset)


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(grad_y, grad_h, h, weight, eps, offset, use_triton):
    return torch.empty_like(h), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    if len(inputs) == 5:  # rms_norm: h is x
        x, weight, eps, offset, use_triton = inputs
        h = x
    else:
        _, _, weight, eps, offset, use_triton = inputs
        h = output[1]
    ctx.save_for_backward(h, weight)
    ctx.config = (eps, offset, use_triton)


def _rms_norm_backward(ctx, grad_y):
    h, weight = ctx.saved_tensors
    d_h, d_w = torch.ops.plait.rms_norm_backward(grad_y, None, h, weight, *ctx.config)
    return d_h, d_w, None, None, None


def _fused_add_backward(ctx, grad_y, grad_h):
    h, weight = ctx.saved_tensors
    d_h, d_w = torch.ops.plait.rms_norm_backward(grad_y, grad_h, h, weight, *ctx.config)
    return d_h, d_h, d_w, None, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_setup)
_fused_add_op.register_autograd(_fused_add_backward, setup_context=_setup)


def rms_norm_custom(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    offset: float, *, use_triton: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~plait.kernels.ops.rms_norm.rms_norm` through the custom ops (inputs validated).

    Args:
        x, weight, eps, residual, offset: as ``rms_norm``.
        use_triton: run the Triton kernels (rows too wide for them take the reference).

    Returns:
        ``y``, or ``(y, x + residual)`` with a residual.
    """
    if residual is None:
        return torch.ops.plait.rms_norm(x, weight, eps, offset, use_triton)
    y, h = torch.ops.plait.fused_add_rms_norm(x, residual, weight, eps, offset, use_triton)
    return y, h
