"""Every environment variable plait-ulysses-sp reads, read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def bench_plot_directory() -> Path:
    """Where the benchmark writes its PNG: ``PLAIT_ULYSSES_BENCH_DIR``, else the current directory."""
    return Path(os.environ.get("PLAIT_ULYSSES_BENCH_DIR") or ".")
