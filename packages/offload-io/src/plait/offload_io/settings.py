"""Every environment variable plait-offload-io reads, read here and nowhere else.

Read on each call (not cached at import) so tests can set them with ``monkeypatch.setenv``.
"""

from __future__ import annotations

import os
import tempfile


def bench_directory() -> str:
    """Directory for I/O benchmarks: ``PLAIT_OFFLOAD_BENCH_DIR``, else the system temp directory.

    Point it at the NVMe drive you will offload to: the figures are about that filesystem.
    """
    return os.environ.get("PLAIT_OFFLOAD_BENCH_DIR") or tempfile.gettempdir()
