"""RMSNorm benchmark: plait's ``rms_norm`` against eager torch, torch.compile and Liger-Kernel.

What runs where:

* CPU (no GPU): plait's public ``rms_norm`` takes the torch reference path, so this measures that
  path's overhead against a naive eager expression and ``torch.compile`` of the same reference.
  Liger-Kernel runs only on CUDA and is reported as such. One torch thread, so figures from a shared
  2-core machine are comparable between runs.
* CUDA: plait's Triton kernel against the same peers plus ``LigerRMSNormFunction`` (and its fused
  residual variant), on inputs larger than the H100's 50 MB L2, rotated so no call finds its input
  in cache.

Every group of candidates is timed interleaved in one run (``plait.kernels.bench.interleaved_timing``)
together with a same-size ``clone()``: the copy moves 2 x nbytes, which measures the bandwidth this
device actually delivers right now. Each op's achieved bandwidth is its ideal traffic (each tensor it
must read or write, once) over its median time, reported as a fraction of that copy bandwidth - the
target on CUDA is >= 0.85 (shared/benchmarks.md); on CPU the fraction is shown without a target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import torch

from plait.kernels.bench import BenchRow, TimingStats, interleaved_timing, one_thread, timing_row
from plait.kernels.ops import rms_norm, rms_norm_reference

EPS = 1e-6
_L2_BYTES = 50 * 2**20  # H100 L2; rotating inputs past 2x this keeps every call reading from HBM
_COPY_PEER = "clone() copy"
_BANDWIDTH_TARGET = 0.85


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark shape.

    Attributes:
        rows: number of rows (batch x sequence).
        hidden: the normalised dimension.
        dtype: input dtype.
        residual: whether the fused residual add is measured.
    """

    rows: int
    hidden: int
    dtype: torch.dtype
    residual: bool = False

    def __post_init__(self) -> None:
        if self.rows < 1 or self.hidden < 1:
            raise ValueError(f"Case: rows={self.rows} and hidden={self.hidden} must be >= 1.")

    def label(self, pass_name: str) -> str:
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        name = "fused_add_rms_norm" if self.residual else "rms_norm"
        return f"{name} {pass_name} {self.rows}x{self.hidden} {dtype}"

    def ideal_bytes(self, backward: bool) -> int:
        """Bytes the op must move at least: each input read once, each output written once.

        Forward reads x (and the residual) and writes y (and h); backward reads the saved input,
        dy (and the gradient of h) and writes dx. The weight and rstd are negligible.
        """
        elements = self.rows * self.hidden * (torch.finfo(self.dtype).bits // 8)
        fwd = 4 if self.residual else 2
        bwd = 4 if self.residual else 3
        return elements * (fwd + (bwd if backward else 0))


def _eager(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None):
    """The naive eager expression people write (computes in the input dtype)."""
    h = x if r is None else x + r
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w
    return y if r is None else (y, h)


def _plait(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None):
    return rms_norm(x, w, EPS, residual=r)


def _liger_fn() -> tuple[Callable | None, str]:
    """Liger-Kernel's RMSNorm callable (same numerics: casting_mode 'gemma' is all-fp32), or why not."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as exc:  # the peer is optional: pip install liger-kernel
        return None, f"Liger-Kernel not importable ({exc.name or exc}); pip install liger-kernel"

    def call(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None):
        if r is None:
            return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)
        return LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "gemma", False)

    return call, ""


def _step(fn: Callable, inputs: list[tuple], backward: bool, reps: int) -> Callable[[], None]:
    """A zero-argument step running ``fn`` ``reps`` times over rotating inputs (and backward)."""
    state = {"i": 0}

    def run() -> None:
        for _ in range(reps):
            x, w, r, dy = inputs[state["i"] % len(inputs)]
            state["i"] += 1
            if not backward:
                with torch.no_grad():
                    fn(x, w, r)
                continue
            out = fn(x, w, r)
            outs = out if isinstance(out, tuple) else (out,)
            grads = (dy,) * len(outs)
            wrt = [x, w] if r is None else [x, w, r]
            torch.autograd.grad(outs, wrt, grads)

    return run


def _inputs(case: Case, device: torch.device, backward: bool) -> list[tuple]:
    nbytes = case.rows * case.hidden * (torch.finfo(case.dtype).bits // 8)
    count = max(1, math.ceil(2 * _L2_BYTES / nbytes)) if device.type == "cuda" else 1
    count = min(count, 8)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        def make():
            t = torch.randn(case.rows, case.hidden, generator=gen).to(device=device, dtype=case.dtype)
            return t.requires_grad_(backward)
        w = (torch.rand(case.hidden, generator=gen) + 0.5).to(device=device, dtype=case.dtype)
        out.append((make(), w.requires_grad_(backward), make() if case.residual else None, make().detach()))
    return out


def _compiled(backward: bool, quick: bool, device: torch.device, probe: tuple) -> tuple[Callable | None, str]:
    """torch.compile of the reference, compiled (and timed) before the timed rounds; or why not."""
    if quick and device.type != "cuda":
        return None, "skipped in --quick: compiling takes ~8 s warm, >60 s cold on 2 CPU cores"
    # Every compile here wraps the same function, and dynamo keys its cache on the code object:
    # without a reset the cases' shapes and grad modes pile up to the recompile limit, after which
    # dynamo silently runs eager and the "torch.compile" row would time eager torch.
    torch.compiler.reset()
    compiled = torch.compile(rms_norm_reference, dynamic=False)

    def call(x, w, r):
        return compiled(x, w, EPS, residual=r)

    start = time.perf_counter()
    try:
        _step(call, [probe], backward, 1)()
    except Exception as exc:  # noqa: BLE001 - any compiler failure only removes this peer
        return None, f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return call, f"compiled in {time.perf_counter() - start:.1f} s (not timed)"


def _bandwidth_row(case: Case, pass_name: str, backward: bool, ours: TimingStats, copy: TimingStats,
                   on_cuda: bool) -> BenchRow:
    nbytes = case.rows * case.hidden * (torch.finfo(case.dtype).bits // 8)
    copy_gbps = 2 * nbytes / copy.median / 1e9
    ours_gbps = case.ideal_bytes(backward) / ours.median / 1e9
    fraction = ours_gbps / copy_gbps
    return BenchRow(
        benchmark=case.label(pass_name), figure="fraction of copy bandwidth", ours=fraction,
        peer=f"{_COPY_PEER} GB/s", peer_value=copy_gbps,
        target=f">= {_BANDWIDTH_TARGET}" if on_cuda else "",
        passed=(fraction >= _BANDWIDTH_TARGET) if on_cuda else None,
        note=f"{ours_gbps:.3g} GB/s of ideal traffic ({case.ideal_bytes(backward) / 2**20:.0f} MiB/call)"
        + ("" if on_cuda else "; CPU reference path, no target"),
    )


def bench_case(case: Case, *, quick: bool, device: torch.device, steps: int, reps: int) -> list[BenchRow]:
    """Time one case forward and forward+backward against every peer; returns the table rows.

    Args:
        case: the shape, dtype and whether the residual add is fused.
        quick: skip the slow-to-build peers on CPU (torch.compile).
        device: where to run (CUDA runs plait's Triton kernel).
        steps: timed interleaved rounds (>= 10).
        reps: calls per timed step (amortises the CUDA synchronise).

    Returns:
        Rows: ours vs eager, torch.compile and Liger, and our fraction of copy bandwidth, per pass.
    """
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else None
    liger, liger_note = _liger_fn()
    if liger is not None and not on_cuda:
        liger, liger_note = None, "Liger-Kernel imports, but its Triton kernels need CUDA; not run on CPU"
    rows: list[BenchRow] = []
    for pass_name, backward in (("fwd", False), ("fwd+bwd", True)):
        inputs = _inputs(case, device, backward)
        compiled, compile_note = _compiled(backward, quick, device, inputs[0])
        copy_src = [item[0].detach() for item in inputs]
        candidates = {
            "plait": _step(_plait, inputs, backward, reps),
            "eager": _step(_eager, inputs, backward, reps),
            "copy": _copy_step(copy_src, reps),
        }
        if compiled is not None:
            candidates["compile"] = _step(compiled, inputs, backward, reps)
        if liger is not None:
            candidates["liger"] = _step(liger, inputs, backward, reps)
        stats = interleaved_timing(candidates, warmup=3, steps=steps, sync=sync)
        per_call = {name: _per_call(s, reps) for name, s in stats.items()}
        label = case.label(pass_name)
        ours = per_call["plait"]
        rows.append(timing_row(label, ours, "eager torch", per_call["eager"]))
        rows.append(_peer_row(label, ours, "torch.compile", per_call.get("compile"), compile_note))
        rows.append(_peer_row(label, ours, "Liger-Kernel", per_call.get("liger"), liger_note,
                              target=1.0 if on_cuda else None))
        bandwidth = _bandwidth_row(case, pass_name, backward, ours, per_call["copy"], on_cuda)
        if not backward:
            checked = _float64_check(case, inputs[0])
            bandwidth = dataclasses.replace(bandwidth, note=f"{bandwidth.note}; {checked}")
        rows.append(bandwidth)
    return rows


def _copy_step(sources: list[torch.Tensor], reps: int) -> Callable[[], None]:
    def run() -> None:
        for i in range(reps):
            sources[i % len(sources)].clone()

    return run


def _float64_check(case: Case, probe: tuple) -> str:
    """Compare plait's forward with a float64 evaluation of the formula, within the tolerance table."""
    from plait.kernels.tolerances import tolerance

    x, w, r, _ = probe
    with torch.no_grad():
        out = rms_norm(x, w, EPS, residual=r)
        y = out[0] if isinstance(out, tuple) else out
        h = (x if r is None else x + r).double()
        want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.double()).to(case.dtype)
    try:
        tolerance("rms_norm_fwd", case.dtype).assert_close(y, want, what=case.label("fwd"))
    except AssertionError:
        return "output does NOT match float64 within the tolerance table"
    return "output matches float64 within the tolerance table"


def _per_call(stats: TimingStats, reps: int) -> TimingStats:
    return TimingStats.of([s / reps for s in stats.samples])


def _peer_row(label: str, ours: TimingStats, peer: str, theirs: TimingStats | None, note: str,
              *, target: float | None = None) -> BenchRow:
    if theirs is None:
        return BenchRow(benchmark=label, figure="time (ms)", ours=ours.median * 1e3, peer=peer, note=note)
    row = timing_row(label, ours, peer, theirs, target_ratio=target)
    return dataclasses.replace(row, note="; ".join(part for part in (row.note, note) if part))


def cases(*, quick: bool, on_cuda: bool) -> list[Case]:
    """The shapes measured: tiny-llama's (hidden 256) on CPU, LLM widths larger than L2 on CUDA."""
    if on_cuda:
        base = [Case(rows=8192, hidden=4096, dtype=torch.bfloat16)]
        if not quick:
            base += [Case(rows=4096, hidden=8192, dtype=torch.bfloat16),
                     Case(rows=16384, hidden=2048, dtype=torch.float16),
                     Case(rows=8192, hidden=4096, dtype=torch.float32)]
    else:
        base = [Case(rows=2048, hidden=256, dtype=torch.float32)]
        if not quick:
            base += [Case(rows=1024, hidden=4096, dtype=torch.float32),
                     Case(rows=2048, hidden=256, dtype=torch.bfloat16)]
    return base + [dataclasses.replace(case, residual=True) for case in base]


def run(quick: bool) -> list[BenchRow]:
    """Run the RMSNorm benchmark on CUDA when available, else on CPU with one thread.

    Args:
        quick: fewer shapes and steps, no torch.compile on CPU (under 30 s on 2 CPU cores).

    Returns:
        The table rows.
    """
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    steps = 10 if quick else 30
    reps = 20 if on_cuda else 2
    rows: list[BenchRow] = []
    with contextlib.nullcontext() if on_cuda else one_thread():
        for case in cases(quick=quick, on_cuda=on_cuda):
            rows += bench_case(case, quick=quick, device=device, steps=steps, reps=reps)
    return rows
