"""Gated activations on a fused gate|up input: ``silu_and_mul`` (SwiGLU) and ``gelu_and_mul`` (GeGLU).

A gated MLP computes ``act(x @ W_gate) * (x @ W_up)``. Serving engines (vLLM's ``SiluAndMul``) and
fused-weight models run one GEMM against the concatenated ``[W_gate; W_up]`` and hand the
activation a single ``[..., 2d]`` tensor whose first half is the gate and second half the up
projection. These ops take that layout and return ``[..., d]``, so the GEMM output is read once
and the intermediate ``act(gate)`` never goes to memory.

Each public function validates its input, then dispatches through
:func:`plait.kernels.dispatch.select_backend`: the Triton kernel (forward and backward, in
``gated_activation_triton``) on CUDA or under the interpreter, the pure-torch reference here
otherwise. The reference is also the oracle the tests compare the kernel with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import dispatch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes the ops accept; anything else is refused before launch."""

GELU_APPROXIMATIONS = ("none", "tanh")
"""The ``approximate`` values of :func:`gelu_and_mul`, as in ``torch.nn.functional.gelu``."""

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
"""Internal activation names shared with the Triton module."""


def check_gated_input(x: torch.Tensor, op: str) -> int:
    """Validate a fused gate|up tensor and return ``d``, the width of each half.

    Args:
        x: the ``[..., 2d]`` input.
        op: the calling op's name, for the error message.

    Returns:
        ``d = x.shape[-1] // 2``.

    Raises:
        TypeError: ``x`` is not a tensor.
        ValueError: ``x`` is 0-dimensional, its last dimension is odd, or its dtype is unsupported.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}.")
    if x.dim() == 0:
        raise ValueError(f"{op}: x is a scalar; pass a [..., 2*d] tensor whose first half is the gate.")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"{op}: dtype {x.dtype} is not supported; cast x to one of {names}.")
    width = x.shape[-1]
    if width % 2:
        raise ValueError(
            f"{op}: the last dimension of x is {width}, which is odd; it must be 2*d with the gate "
            f"in [..., :d] and the up projection in [..., d:]."
        )
    return width // 2


def gated_activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Pure-torch ``act(gate) * up`` in fp32 with one cast back: the CPU path and the test oracle.

    Differentiable through ordinary autograd.

    Args:
        x: ``[..., 2d]``, gate first.
        activation: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.

    Returns:
        ``[..., d]`` in ``x.dtype``.

    Raises:
        ValueError: unknown ``activation``.
    """
    # fp32 for the half types (float64 stays float64, so gradcheck can probe the reference).
    compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
    gate, up = compute.chunk(2, dim=-1)
    if activation == "silu":
        act = F.silu(gate)
    elif activation == "gelu":
        act = F.gelu(gate, approximate="none")
    elif activation == "gelu_tanh":
        act = F.gelu(gate, approximate="tanh")
    else:
        raise ValueError(f"activation={activation!r} is not one of {', '.join(ACTIVATIONS)}.")
    out = act * up
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _gated_activation(x: torch.Tensor, activation: str, op: str) -> torch.Tensor:
    check_gated_input(x, op)
    use_triton = dispatch.select_backend(x) == dispatch.TRITON
    if not (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():
        # The custom op (opaque to torch.compile); eager autograd keeps the autograd Function's node.
        return torch.ops.plait.gated_activation(x, activation, use_triton)
    if use_triton:
        # Imported here so that CPU installs without Triton never import it.
        from plait.kernels.ops.gated_activation_triton import gated_activation_triton

        return gated_activation_triton(x, activation)
    return gated_activation_reference(x, activation)


@torch.library.custom_op("plait::gated_activation", mutates_args=())
def _gated_op(x: torch.Tensor, activation: str, use_triton: bool) -> torch.Tensor:
    if use_triton:
        from plait.kernels.ops.gated_activation_triton import gated_forward

        return gated_forward(x, activation)
    return gated_activation_reference(x, activation).contiguous()  # the fake's strides


@_gated_op.register_fake
def _gated_fake(x, activation, use_triton):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("plait::gated_activation_backward", mutates_args=())
def _gated_backward_op(grad: torch.Tensor, x: torch.Tensor, activation: str, use_triton: bool) -> torch.Tensor:
    if use_triton:
        from plait.kernels.ops.gated_activation_triton import gated_backward

        return gated_backward(x, grad, activation)
    from plait.kernels.ops.moe_grouped import gate_product_backward

    # The reference's steps as autograd runs them: in x's dtype for fp32/fp64, else in fp32.
    precision = "input" if x.dtype in (torch.float32, torch.float64) else "fp32"
    return gate_product_backward(x, grad, activation, precision)[1]


@_gated_backward_op.register_fake
def _gated_backward_fake(grad, x, activation, use_triton):
    return torch.empty_like(x)


def _gated_setup(ctx, inputs, output) -> None:
    x, activation, use_triton = inputs
    ctx.save_for_backward(x)
    ctx.activation, ctx.use_triton = activation, use_triton


def _gated_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.plait.gated_activation_backward(grad, x, ctx.activation, ctx.use_triton), None, None


_gated_op.register_autograd(_gated_backward, setup_context=_gated_setup)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused input: ``silu(x[..., :d]) * x[..., d:]``.

    Same contract as vLLM's ``SiluAndMul``. Differentiable on both backends.

    Args:
        x: ``[..., 2d]`` in fp32, bf16 or fp16; any strides.

    Returns:
        A new contiguous ``[..., d]`` tensor of ``x.dtype``.

    Raises:
        TypeError: ``x`` is not a tensor.
        ValueError: odd last dimension, unsupported dtype, or an invalid ``PLAIT_KERNEL_BACKEND``.
    """
    return _gated_activation(x, "silu", "silu_and_mul")


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU on a fused input: ``gelu(x[..., :d]) * x[..., d:]``.

    Same contract as vLLM's ``GeluAndMul``. Differentiable on both backends.

    Args:
        x: ``[..., 2d]`` in fp32, bf16 or fp16; any strides.
        approximate: ``"none"`` for the exact erf GELU, ``"tanh"`` for the tanh approximation
            (HF's ``gelu_pytorch_tanh`` / ``gelu_new``).

    Returns:
        A new contiguous ``[..., d]`` tensor of ``x.dtype``.

    Raises:
        TypeError: ``x`` is not a tensor.
        ValueError: ``approximate`` is not ``"none"`` or ``"tanh"``, odd last dimension,
            unsupported dtype, or an invalid ``PLAIT_KERNEL_BACKEND``.
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(
            f"gelu_and_mul: approximate={approximate!r} is not supported; pass 'none' (erf) or 'tanh'."
        )
    return _gated_activation(x, "gelu" if approximate == "none" else "gelu_tanh", "gelu_and_mul")


class SiluAndMul(nn.Module):
    """Module form of :func:`silu_and_mul` (``[..., 2d] -> [..., d]``), as vLLM's layer of that name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``silu(x[..., :d]) * x[..., d:]``."""
        return silu_and_mul(x)


class GeluAndMul(nn.Module):
    """Module form of :func:`gelu_and_mul`.

    Args:
        approximate: ``"none"`` (erf) or ``"tanh"``.

    Raises:
        ValueError: any other ``approximate``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"GeluAndMul: approximate={approximate!r} must be 'none' or 'tanh'.")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``gelu(x[..., :d]) * x[..., d:]``."""
        return gelu_and_mul(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
