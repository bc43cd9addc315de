"""RMSNorm, optionally fused with the residual add: public function, torch reference, module.

This is the worked example of plait's op pattern (docs/conventions.md): validate, pick a
backend with :func:`plait.kernels.dispatch.select_backend`, and run either the Triton path
(``rms_norm_triton``, imported only when chosen) or :func:`rms_norm_reference`, which is both the
CPU path and the oracle the tests compare the kernel against.

Numerics (both paths): the reduction, the scaling and the weight multiply are done in fp32 and
the result is cast to the input dtype once. With a residual, ``h = x + residual`` is rounded to
the input dtype first (it is returned as the new residual stream, so it must be the same bits the
next layer would see from an eager ``x + residual``), then normalised.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.kernels import dispatch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch RMSNorm: the CPU path and the test oracle (differentiable by autograd).

    ``y = h * rsqrt(mean(h^2, -1) + eps) * (offset + weight)`` with ``h = x`` or ``h = x + residual``,
    computed in fp32 (float64 stays float64) and cast to ``x.dtype``. No validation: call
    :func:`rms_norm` for checked inputs.

    Args:
        x: input, hidden size last, any leading shape.
        weight: ``[N]`` scale.
        eps: added to the mean square before the square root.
        residual: optional tensor of x's shape and dtype, added to x first.
        offset: added to the weight (1.0 for Gemma's ``1 + w``).

    Returns:
        ``y`` of x's shape and dtype; with a residual, ``(y, h)`` where ``h = x + residual``.
    """
    h = x if residual is None else x + residual
    compute = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(compute)
    rstd = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (hf * rstd * (weight.to(compute) + offset)).to(x.dtype)
    return y if residual is None else (y, h)


def _validate(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, offset: float
) -> None:
    """Refuse bad inputs before any launch, naming the argument and the fix."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rms_norm: x must be a torch.Tensor, got {type(x).__name__}.")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm: weight must be a torch.Tensor, got {type(weight).__name__}.")
    names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rms_norm: x.dtype={x.dtype} is not supported; cast x to one of {names}.")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"rms_norm: weight.dtype={weight.dtype} is not supported; cast weight to one of {names}."
        )
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(
            f"rms_norm: x.shape={tuple(x.shape)} has no hidden dimension; pass x with the hidden size "
            f"(>= 1) as its last dimension."
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight.shape={tuple(weight.shape)} must be ({x.shape[-1]},), the last dim of "
            f"x.shape={tuple(x.shape)}; pass a 1-D weight of the hidden size."
        )
    if weight.device != x.device:
        raise ValueError(
            f"rms_norm: weight is on {weight.device} but x is on {x.device}; move weight to {x.device}."
        )
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(
                f"rms_norm: residual must be a torch.Tensor or None, got {type(residual).__name__}."
            )
        if residual.shape != x.shape:
            raise ValueError(
                f"rms_norm: residual.shape={tuple(residual.shape)} must equal x.shape={tuple(x.shape)}; "
                f"pass the residual stream that x is added to."
            )
        if residual.dtype != x.dtype:
            raise ValueError(
                f"rms_norm: residual.dtype={residual.dtype} must equal x.dtype={x.dtype}; cast one of them "
                f"(h = x + residual is kept in the input dtype)."
            )
        if residual.device != x.device:
            raise ValueError(
                f"rms_norm: residual is on {residual.device} but x is on {x.device}; move it to {x.device}."
            )
    for name, value in (("eps", eps), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"rms_norm: {name}={value!r} must be a finite float; pass e.g. 1e-6.")
    if eps < 0:
        raise ValueError(f"rms_norm: eps={eps!r} must be >= 0; pass e.g. 1e-6 (1e-5 for some models).")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, optionally fused with the residual add.

    Without ``residual``: ``y = x * rsqrt(mean(x^2) + eps) * (offset + weight)``, computed in fp32
    and cast to ``x.dtype``. With ``residual``: ``h = x + residual`` (in the input dtype), returns
    ``(rms_norm(h), h)``: the normalised output and the new residual stream (vLLM's
    ``fused_add_rms_norm``, but out of place). Differentiable in x, weight and residual.

    Runs the Triton kernel on CUDA and the torch reference elsewhere; ``PLAIT_KERNEL_BACKEND``
    forces one (``triton`` on CPU needs ``TRITON_INTERPRET=1``). Rows wider than
    ``rms_norm_triton.MAX_FUSED_N`` (65536) always take the reference: they do not fit one program.

    Args:
        x: fp32, bf16 or fp16 input of any leading shape (any strides).
        weight: ``[N]`` scale, N = ``x.shape[-1]``, fp32/bf16/fp16 (may differ from x's dtype).
        eps: added to the mean square, >= 0.
        residual: optional tensor of x's shape and dtype, added to x before normalising.
        offset: added to the weight; 1.0 for Gemma-style ``(1 + w)`` weights.

    Returns:
        ``y`` (x's shape and dtype), or ``(y, h)`` with a residual.

    Raises:
        TypeError: x, weight or residual is not a tensor.
        ValueError: unsupported dtype, weight shape other than ``[x.shape[-1]]``, residual shape
            or dtype unlike x's, tensors on different devices, negative or non-finite eps, or an
            invalid ``PLAIT_KERNEL_BACKEND`` (each message names the argument and the fix).
    """
    _validate(x, weight, eps, residual, offset)
    tensors = (x, weight) if residual is None else (x, weight, residual)
    backend = dispatch.select_backend(*tensors)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or torch.compiler.is_compiling():
        # The custom ops (opaque to torch.compile); eager autograd keeps the autograd Function's node.
        from plait.kernels.ops import rms_norm_op

        return rms_norm_op.rms_norm_custom(x, weight, float(eps), residual, float(offset),
                                           use_triton=backend == dispatch.TRITON)
    if backend == dispatch.TRITON:
        # Imported here, not at module top: CPU installs without Triton never reach this line.
        from plait.kernels.ops import rms_norm_triton

        if rms_norm_triton.supports_hidden_size(x.shape[-1]):
            return rms_norm_triton.rms_norm_triton(x, weight, eps, residual=residual, offset=offset)
    return rms_norm_reference(x, weight, eps, residual=residual, offset=offset)


class RMSNorm(nn.Module):
    """RMSNorm layer over the last dimension, with an optional fused residual add.

    The weight is initialised to ``1 - offset`` so the layer starts as a pure normalisation
    whatever the convention (ones for Llama, zeros for Gemma's ``offset=1``).

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square, >= 0.
        offset: added to the weight in the forward (1.0 for Gemma).
        device: where to create the weight.
        dtype: the weight's dtype (default: torch's default dtype).

    Raises:
        ValueError: ``hidden_size < 1``, negative or non-finite ``eps`` or non-finite ``offset``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(
                f"RMSNorm: hidden_size={hidden_size!r} must be an int >= 1; pass the model width."
            )
        if not (isinstance(eps, int | float) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"RMSNorm: eps={eps!r} must be a finite float >= 0; pass e.g. 1e-6.")
        if not (isinstance(offset, int | float) and math.isfinite(offset)):
            raise ValueError(
                f"RMSNorm: offset={offset!r} must be a finite float; pass 0.0, or 1.0 for Gemma."
            )
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Set the weight so that ``offset + weight == 1``."""
        with torch.no_grad():
            self.weight.fill_(1.0 - self.offset)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (or ``x + residual``).

        Args:
            x: input with ``hidden_size`` as its last dimension.
            residual: optional residual stream of x's shape and dtype.

        Returns:
            ``y``, or ``(y, x + residual)`` when ``residual`` is given.
        """
        return rms_norm(x, self.weight, self.eps, residual=residual, offset=self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps:g}, offset={self.offset:g}"
