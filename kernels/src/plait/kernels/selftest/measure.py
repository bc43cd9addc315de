"""How the selftest measures: error against the tolerance table's bound, and bandwidth against a
plain ``copy_`` on the same device (CUDA events, warm-up, median of repeats)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from plait.kernels.selftest.core import FAIL, PASS, Outcome, SelftestContext
from plait.kernels.tolerances import tolerance

BANDWIDTH_GOAL = 0.90  # share of copy_'s bandwidth a memory-bound op should reach on a GPU


def error_ratio(actual: torch.Tensor, expected: torch.Tensor, op: str, dtype: torch.dtype) -> float:
    """The worst ``|actual - expected| / (atol + rtol * |expected|)`` for ``(op, dtype)``'s tolerance.

    A value <= 1 is within the table's bound (what ``Tolerance.assert_close`` accepts); the row
    shows the number, so a GPU run says how close each kernel comes to its bound.

    Args:
        actual: the fast path's tensor.
        expected: the reference's tensor (same shape).
        op: the tolerance table's op key, e.g. ``"rms_norm_fwd"``.
        dtype: the inputs' dtype.

    Returns:
        The worst ratio (``inf`` where one side is not finite and the other is).

    Raises:
        ValueError: the shapes differ.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"{op}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    tol = tolerance(op, dtype)
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.equal(torch.isfinite(a), torch.isfinite(e)):
        return float("inf")
    finite = torch.isfinite(e)
    diff = (a - e).abs()[finite]
    bound = tol.atol + tol.rtol * e.abs()[finite]
    if diff.numel() == 0:
        return 0.0
    exact = bound == 0
    if bool((diff[exact] > 0).any()):
        return float("inf")
    return float((diff[~exact] / bound[~exact]).max()) if bool((~exact).any()) else 0.0


def accuracy_outcome(ratios: dict[str, float], note: str = "") -> Outcome:
    """PASS when every case's ratio is <= 1; the value is the worst ratio, the note names its case."""
    worst = max(ratios, key=ratios.get)
    status = PASS if ratios[worst] <= 1.0 else FAIL
    return Outcome(status, "max err / bound", ratios[worst], "<= 1",
                   f"{len(ratios)} cases; worst {worst}" + (f"; {note}" if note else ""))


def device_seconds(fn: Callable[[], object], ctx: SelftestContext, *, repeats: int, warmup: int = 3) -> float:
    """Median seconds of one call of ``fn`` on ``ctx.device``.

    On CUDA each repeat is timed with a pair of CUDA events around the call (so host overhead
    between launches is not counted twice); on the CPU with ``time.perf_counter``.

    Args:
        fn: one call of the op.
        ctx: the context.
        repeats: timed calls (median taken).
        warmup: untimed calls first (compilation, autotuning, caches).

    Returns:
        The median in seconds.
    """
    for _ in range(warmup):
        fn()
    ctx.sync()
    samples = []
    for _ in range(repeats):
        if ctx.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth(nbytes: int, ctx: SelftestContext, *, repeats: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` for ``nbytes`` on ``ctx.device`` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * nbytes / device_seconds(lambda: dst.copy_(src), ctx, repeats=repeats, warmup=3)


def bandwidth_outcome(fn: Callable[[], object], bytes_moved: int, ctx: SelftestContext, *, note: str) -> Outcome:
    """An op's achieved bandwidth as a share of ``copy_``'s for the same byte count.

    Args:
        fn: one call of the op.
        bytes_moved: bytes the op must read plus write (its minimum traffic).
        ctx: the context.
        note: the shape and dtype, for the row.

    Returns:
        On a GPU: PASS when the share is >= :data:`BANDWIDTH_GOAL`. On a dry run the same code
        runs but the row carries no target and says its number is not a GPU figure.
    """
    repeats = ctx.pick(20, 1)  # the dry run only exercises this code: one timed call is enough
    seconds = device_seconds(fn, ctx, repeats=repeats, warmup=ctx.pick(3, 0))
    copy = copy_bandwidth(max(bytes_moved // 2, 1), ctx, repeats=repeats)
    share = (bytes_moved / seconds) / copy
    text = f"{note}; {bytes_moved / seconds / 1e9:.1f} GB/s vs copy_ {copy / 1e9:.1f} GB/s"
    if ctx.dry_run:
        return Outcome(PASS, "share of copy BW", share, "", "dry run: CPU timing, not a GPU figure; " + text)
    status = PASS if share >= BANDWIDTH_GOAL else FAIL
    return Outcome(status, "share of copy BW", share, f">= {BANDWIDTH_GOAL:.2f}", text)
