"""plait-kernels' benchmark suite: ``plait bench kernels [--quick]``.

Registered as the ``kernels`` entry point of the ``plait.benchmarks`` group. Each kernel has its
own module here exposing ``run(quick: bool) -> list[BenchRow]``; this suite runs them in the order
of :data:`BENCHMARKS` and concatenates their rows. A kernel added later appends its module name.
"""

from __future__ import annotations

import importlib

from plait.kernels.bench import BenchRow

BENCHMARKS: tuple[str, ...] = (
    "plait.kernels.benchmarks.rms_norm_bench",
)


def run(quick: bool) -> list[BenchRow]:
    """Run every kernel benchmark and return their rows.

    Args:
        quick: small shapes and few steps (the whole suite in about a minute on 2 CPU cores).

    Returns:
        The rows of all benchmarks, in :data:`BENCHMARKS` order.
    """
    rows: list[BenchRow] = []
    for module_name in BENCHMARKS:
        rows += importlib.import_module(module_name).run(quick=quick)
    return rows
