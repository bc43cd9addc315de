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


import pytest  # noqa: E402 - after the environment is set, on purpose


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    """Force every op onto its Triton path (the interpreter on CPU); returns the device to use.

    Skips when triton is not installed; fails loudly when triton was imported in compiled mode
    on a machine without CUDA (then nothing would run), which only happens when something
    imported triton before this conftest set ``TRITON_INTERPRET=1``.
    """
    pytest.importorskip("triton")
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "triton")
    if _cuda_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        pytest.fail("triton was imported in compiled mode before the root conftest.py ran; "
                    "set TRITON_INTERPRET=1 in the environment before anything imports triton.")
    return "cpu"


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that initialises ``torch.distributed`` in the pytest process must tear it down: a
    group left behind makes later tests ("refused before any process group exists") fail far from
    the cause. Reported as an error of the test that leaked it, and destroyed for the ones after."""
    try:
        import torch.distributed as dist
    except ImportError:
        yield
        return
    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group initialised; destroy it before it returns")
