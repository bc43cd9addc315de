"""Every environment variable plait-kernels reads, read here and nowhere else.

Keeping the reads in one module means a user can find every switch in one place and
tests can override them by setting the environment before calling these functions
(they are read on each call, not cached at import, so a test's ``monkeypatch.setenv``
takes effect).
"""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_BACKENDS = ("auto", "triton", "reference")


def kernel_backend() -> str:
    """Return the kernel backend forced by ``PLAIT_KERNEL_BACKEND`` (default ``auto``).

    Returns:
        One of ``auto``, ``triton`` or ``reference``.

    Raises:
        ValueError: the variable holds anything else; the message names the value and the fix.
    """
    value = os.environ.get("PLAIT_KERNEL_BACKEND", "auto").strip().lower() or "auto"
    if value not in KERNEL_BACKENDS:
        raise ValueError(
            f"PLAIT_KERNEL_BACKEND={value!r} is not a kernel backend; "
            f"set it to one of {', '.join(KERNEL_BACKENDS)} or unset it (auto)."
        )
    return value


def triton_interpret() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def test_timeout_scale() -> float:
    """Multiplier for distributed-test timeouts (``PLAIT_TEST_TIMEOUT_SCALE``, default 1.0).

    A slow machine can stretch every harness timeout at once without editing tests.
    """
    raw = os.environ.get("PLAIT_TEST_TIMEOUT_SCALE", "1.0")
    try:
        scale = float(raw)
    except ValueError as exc:
        raise ValueError(
            f"PLAIT_TEST_TIMEOUT_SCALE={raw!r} is not a number; set it to a positive float such as 2.0."
        ) from exc
    if scale <= 0:
        raise ValueError(f"PLAIT_TEST_TIMEOUT_SCALE={raw!r} must be positive; set it to e.g. 1.0 or 2.0.")
    return scale


def bench_dir() -> Path:
    """Where ``plait bench`` writes a run's JSON by default (``PLAIT_BENCH_DIR``).

    Default: ``$XDG_CACHE_HOME/plait/bench`` (``~/.cache/plait/bench``), outside any source
    checkout, so running a benchmark never changes tracked files.
    """
    raw = os.environ.get("PLAIT_BENCH_DIR", "").strip()
    if raw:
        return Path(raw).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "plait" / "bench"
