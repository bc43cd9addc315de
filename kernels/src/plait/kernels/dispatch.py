"""Choosing between a kernel's Triton path and its pure-torch reference.

Every public op in plait calls :func:`select_backend` with its input tensors. The rule:
Triton for CUDA tensors when Triton imports, the reference everywhere else, unless
``PLAIT_KERNEL_BACKEND`` forces one. Forcing ``triton`` on CPU tensors is only valid under
``TRITON_INTERPRET=1`` (that is how the test-suite runs Triton kernels without a GPU).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from plait.kernels import settings

TRITON = "triton"
REFERENCE = "reference"


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` can succeed (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def select_backend(*tensors: torch.Tensor) -> str:
    """Pick ``"triton"`` or ``"reference"`` for an op on ``tensors``.

    Args:
        *tensors: the op's tensor inputs; the first one decides the device.

    Returns:
        ``"triton"`` or ``"reference"``.

    Raises:
        ValueError: ``PLAIT_KERNEL_BACKEND`` is invalid, or forces ``triton`` where it cannot
            run (Triton missing, or CPU tensors without ``TRITON_INTERPRET=1``).
    """
    forced = settings.kernel_backend()
    on_cuda = bool(tensors) and tensors[0].is_cuda
    if forced == REFERENCE:
        return REFERENCE
    if forced == TRITON:
        if not triton_available():
            raise ValueError(
                "PLAIT_KERNEL_BACKEND=triton but triton is not installed; "
                "pip install triton, or set PLAIT_KERNEL_BACKEND=auto."
            )
        if not on_cuda and not settings.triton_interpret():
            raise ValueError(
                "PLAIT_KERNEL_BACKEND=triton with CPU tensors needs TRITON_INTERPRET=1 "
                "(the Triton interpreter); set it, or use PLAIT_KERNEL_BACKEND=auto."
            )
        return TRITON
    return TRITON if on_cuda and triton_available() else REFERENCE


def triton_device_ok(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel may be launched on ``tensor`` (CUDA, or CPU under the interpreter)."""
    return tensor.is_cuda or settings.triton_interpret()


def check_triton_launch_mode(kernel: object, tensor: torch.Tensor, *, op: str) -> bool:
    """Refuse a Triton launch whose jit mode does not fit ``tensor``'s device.

    ``triton.jit`` (for plait's kernels and for triton's own library, e.g. ``tl.sum``) decides
    compiled vs interpreted once, when triton is imported, from ``TRITON_INTERPRET``: setting the
    variable later cannot switch it. Every launcher calls this so the mismatch is a clear error
    instead of a failure deep inside Triton.

    Args:
        kernel: the ``@triton.jit`` kernel about to launch.
        tensor: an input tensor (its device decides what mode is needed).
        op: the op's name, for the message.

    Returns:
        Whether the kernel runs under the interpreter.

    Raises:
        RuntimeError: interpreted kernels with CUDA tensors, or compiled kernels with CPU tensors.
    """
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kernel, InterpretedFunction)
    if interpreted == tensor.is_cuda:
        mode = "for the interpreter" if interpreted else "for the GPU"
        raise RuntimeError(
            f"the Triton {op} kernel was jitted {mode} but got {tensor.device.type} tensors: set "
            "TRITON_INTERPRET=1 in the environment before the process imports triton to run kernels on "
            "CPU tensors, leave it unset on CUDA, or use PLAIT_KERNEL_BACKEND=reference on CPU."
        )
    return interpreted
