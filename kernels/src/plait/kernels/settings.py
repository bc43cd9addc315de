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


def _positive_number(name: str, default: str, *, allow_zero: bool = False) -> float:
    raw = os.environ.get(name, default).strip() or default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number; set it to e.g. {default} or unset it.") from exc
    if value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "positive"
        raise ValueError(f"{name}={raw!r} must be {bound}; set it to e.g. {default} or unset it.")
    return value


def collective_history() -> int:
    """How many collectives each rank's flight log keeps (``PLAIT_COLLECTIVE_HISTORY``, default 1024).

    Raises:
        ValueError: not a positive number; the message names the value and the fix.
    """
    return max(1, int(_positive_number("PLAIT_COLLECTIVE_HISTORY", "1024")))


def collective_publish_interval() -> float:
    """Seconds between a rank's reports of its last collective to the c10d store
    (``PLAIT_COLLECTIVE_PUBLISH_S``, default 0.5; 0 turns the reports off, and with them the
    naming of a missing rank in a collective's error).

    Raises:
        ValueError: not a number, or negative; the message names the value and the fix.
    """
    return _positive_number("PLAIT_COLLECTIVE_PUBLISH_S", "0.5", allow_zero=True)
