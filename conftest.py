"""Test-session setup shared by every package's tests.

Triton decides at import time whether its language functions are compiled or interpreted, so
``TRITON_INTERPRET=1`` must be in the environment before anything imports triton. On a machine
without CUDA the Triton paths can only run under the interpreter, so set it here, before any
test module is collected. Tests that force the Triton path still set
``PLAIT_KERNEL_BACKEND=triton`` themselves.
"""

import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
