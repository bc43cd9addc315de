"""GPU rows of ``plait bench inference-kernels``: each op's Triton path in bf16 against peers.

Method (shared/benchmarks.md): first the device's copy bandwidth (a 1 GiB device-to-device copy,
read + write bytes) and a large bf16 GEMM are measured in the same run and used as denominators;
every candidate is timed with ``triton.testing.do_bench`` (median), in interleaved rounds
(A B C, A B C, ...) whose medians feed the p10/p90; inputs are larger than L2 or rotated through
enough copies to be; outputs are checked against a float64 reference before timing.

Figures: for each op and size, one row giving plait's achieved fraction of the copy bandwidth
(ideal bytes: every input read once, every output written once) and one timing row per peer -
torch eager (the op's reference), ``torch.compile`` of the reference, and Liger-Kernel where it
has the op (its fused MoE). Targets: paged decode >= 0.75 of copy bandwidth; fused MoE faster
than Liger's at every token count.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import torch

from plait.inference_kernels.moe.fused_moe import fused_experts, fused_experts_reference
from plait.inference_kernels.moe.routing import topk_routing
from plait.inference_kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from plait.inference_kernels.paged_attention_kv_write import write_kv_rotary, write_kv_rotary_reference
from plait.kernels.bench import BenchRow, TimingStats, timing_row
from plait.kernels.tolerances import tolerance

Timer = Callable[[Callable[[], object]], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuPlan:
    """Sizes the GPU rows run (the defaults are real model shapes).

    Attributes:
        moe: ``(name, hidden, intermediate, experts, top_k)`` blocks.
        moe_tokens: token counts per block.
        paged: ``(batch, context, q_heads, kv_heads, head_dim, block_size)`` decode cases.
        kv_write_tokens: token counts for write_kv_rotary (Llama-3-8B heads: 32 q, 8 kv, 128).
        rounds: interleaved timing rounds (>= 1).
        copy_bytes: bytes of the bandwidth probe's source tensor.
        gemm_size: n of the n x n x n bf16 GEMM probe.
        use_compile: include torch.compile peers.
    """

    moe: tuple[tuple[str, int, int, int, int], ...] = (("mixtral-8x7b", 4096, 14336, 8, 2),)
    moe_tokens: tuple[int, ...] = (1, 16, 128, 1024)
    paged: tuple[tuple[int, int, int, int, int, int], ...] = ((8, 4096, 32, 8, 128, 16), (64, 2048, 32, 8, 128, 16))
    kv_write_tokens: tuple[int, ...] = (256, 8192)
    rounds: int = 5
    copy_bytes: int = 1 << 30
    gemm_size: int = 8192
    use_compile: bool = True

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"GpuPlan.rounds={self.rounds} must be >= 1.")


FULL_PLAN = GpuPlan(
    moe=(("mixtral-8x7b", 4096, 14336, 8, 2), ("qwen1.5-moe-a2.7b", 2048, 1408, 60, 4)),
    moe_tokens=(1, 4, 16, 64, 256, 1024, 4096),
    paged=((1, 8192, 32, 8, 128, 16), (8, 4096, 32, 8, 128, 16), (32, 4096, 32, 8, 128, 16),
           (128, 2048, 32, 8, 128, 16), (32, 4096, 32, 32, 128, 16)),
    kv_write_tokens=(1, 256, 8192),
)


def do_bench_seconds(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in seconds by ``triton.testing.do_bench`` (CUDA only)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def _interleaved(candidates: dict[str, Callable[[], object]], timer: Timer, rounds: int,
                 failures: dict[str, str]) -> dict[str, TimingStats]:
    """Time the candidates in rounds A B C, A B C; a peer that raises is dropped and noted."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            if name in failures:
                continue
            try:
                samples[name].append(timer(fn))
            except Exception as exc:  # only peers may fail: ours re-raises
                if name == "plait":
                    raise
                failures[name] = f"{type(exc).__name__} while timing"
    return {name: TimingStats.of(values) for name, values in samples.items() if name not in failures}


def _rotating(inputs: list[tuple]) -> Callable[[Callable], Callable[[], object]]:
    """Wrap an op so each call takes the next input set (keeps working sets out of L2)."""
    def bind(op):
        cycle = itertools.cycle(inputs)
        return lambda: op(*next(cycle))
    return bind


def _copies_for_l2(bytes_per_set: int, device: torch.device) -> int:
    l2 = 50 << 20
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", l2)
    return max(1, min(16, math.ceil(4 * l2 / max(bytes_per_set, 1))))


def _peers(reference: Callable, use_compile: bool) -> dict[str, Callable]:
    peers = {"torch eager": reference}
    if use_compile:
        peers["torch.compile"] = torch.compile(reference)
    return peers


def _op_rows(name: str, ours: Callable, peers: dict[str, Callable | None], ideal_bytes: int, copy_bw: float,
             timer: Timer, rounds: int, *, bw_target: float | None = None,
             ratio_targets: dict[str, float] | None = None, notes: dict[str, str] | None = None) -> list[BenchRow]:
    """Time ours and its peers interleaved; one bandwidth row plus one timing row per peer."""
    runnable, notes = {"plait": ours}, dict(notes or {})
    for peer_name, fn in peers.items():
        if fn is None:
            continue
        try:  # a peer that cannot run this case (compile failure, missing kernel) is reported, not fatal
            fn()
            runnable[peer_name] = fn
        except Exception as exc:  # noqa: BLE001
            notes[peer_name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    stats = _interleaved(runnable, timer, rounds, notes)
    fraction = ideal_bytes / stats["plait"].median / copy_bw
    rows = [BenchRow(benchmark=name, figure="fraction of copy BW", ours=fraction,
                     target="" if bw_target is None else f">= {bw_target:g}",
                     passed=None if bw_target is None else fraction >= bw_target,
                     note=f"{ideal_bytes / 2**20:.1f} MiB ideal traffic")]
    for peer_name in peers:
        target = (ratio_targets or {}).get(peer_name)
        row = timing_row(name, stats["plait"], peer_name, stats.get(peer_name), target_ratio=target,
                         unit_scale=1e6, figure="time (us)")
        if peer_name in notes:  # the peer did not run: nothing to pass or fail against
            row = dataclasses.replace(row, note=f"{row.note}; {notes[peer_name]}".strip("; "), passed=None)
        rows.append(row)
    return rows


def _check(name: str, ours, expected, tol_key: str) -> str:
    try:
        tolerance(tol_key, torch.bfloat16).assert_close(ours, expected.to(ours.dtype), what=name)
    except AssertionError as exc:
        return f"CHECK FAILED vs float64: {str(exc).splitlines()[0]}"
    return ""


def measure_device(plan: GpuPlan, device: torch.device, timer: Timer) -> tuple[float, float]:
    """``(copy bytes/s, bf16 GEMM FLOP/s)`` measured now, on this device."""
    copy_bw = 2 * plan.copy_bytes / _copy_seconds(plan.copy_bytes, device, timer)
    n = plan.gemm_size
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    gemm = 2 * n**3 / timer(lambda: a @ b)
    return copy_bw, gemm


def _copy_seconds(nbytes: int, device: torch.device, timer: Timer) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def _bound(fn: Callable, *args, **kwargs) -> Callable[[], object]:
    """``fn`` with its arguments fixed now (not looked up when called, as a loop's lambda would)."""
    return lambda: fn(*args, **kwargs)


def _liger_moe():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return None
    return lambda x, w_gate_up, w_down, weights, ids: LigerFusedMoEFunction.apply(
        x, w_gate_up, w_down, ids, weights.to(x.dtype))


def moe_gpu_rows(plan: GpuPlan, device, copy_bw: float, timer: Timer) -> list[BenchRow]:
    """fused_experts (Triton) vs eager, compile and Liger, per block and token count."""
    rows, liger = [], _liger_moe()
    for label, hidden, inter, experts, top_k in plan.moe:
        gen = torch.Generator(device=device).manual_seed(0)
        w_gate_up = torch.randn(experts, 2 * inter, hidden, device=device, generator=gen,
                                dtype=torch.bfloat16) / hidden**0.5
        w_down = torch.randn(experts, hidden, inter, device=device, generator=gen, dtype=torch.bfloat16) / inter**0.5
        for tokens in plan.moe_tokens:
            x = torch.randn(tokens, hidden, device=device, generator=gen, dtype=torch.bfloat16)
            weights, ids = topk_routing(torch.randn(tokens, experts, device=device, generator=gen), top_k)
            args = (x, w_gate_up, w_down, weights, ids)
            ours = fused_experts(*args, check_bounds=False)
            note = _check(label, ours, fused_experts_reference(*(t.double() for t in args[:3]), weights, ids),
                          "fused_moe_fwd") if tokens <= 256 else ""
            hit = int(torch.unique(ids).numel())
            ideal = hit * 3 * inter * hidden * 2 + 2 * tokens * hidden * 2
            peers = {name: _bound(f, *args) for name, f in _peers(fused_experts_reference,
                                                                   plan.use_compile).items()}
            peers["Liger-Kernel"] = _bound(liger, *args) if liger else None
            notes = {} if liger else {"Liger-Kernel": "liger-kernel with fused_moe not installed"}
            name = f"fused_moe {label} T={tokens} bf16" + (f" [{note}]" if note else "")
            rows += _op_rows(name, _bound(fused_experts, *args, check_bounds=False), peers, ideal, copy_bw,
                             timer, plan.rounds, ratio_targets={"Liger-Kernel": 1.0}, notes=notes)
    return rows


def paged_gpu_rows(plan: GpuPlan, device, copy_bw: float, timer: Timer) -> list[BenchRow]:
    """paged_decode_attention (Triton) vs eager and compile, as fractions of copy bandwidth."""
    rows = []
    for batch, context, q_heads, kv_heads, head_dim, block_size in plan.paged:
        max_blocks = context // block_size
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        sets = []
        for seed in range(_copies_for_l2(kv_bytes, torch.device(device))):
            gen = torch.Generator(device=device).manual_seed(seed)
            shape = (batch * max_blocks, block_size, kv_heads, head_dim)
            k_cache = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
            v_cache = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
            q = torch.randn(batch, q_heads, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
            tables = torch.randperm(batch * max_blocks, device=device, generator=gen).view(batch, max_blocks).int()
            seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
            sets.append((q, k_cache, v_cache, tables, seq_lens))
        scale = 1 / math.sqrt(head_dim)
        q, k_cache, v_cache, tables, seq_lens = sets[0]
        ours_out = paged_decode_attention(*sets[0], scale=scale)
        expected = paged_decode_attention_reference(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens,
                                                    scale)
        note = _check("paged", ours_out, expected, "paged_decode_attention_fwd")
        bind = _rotating(sets)
        ours = bind(lambda *a, scale=scale: paged_decode_attention(*a, scale=scale, check_bounds=False))
        peers = {name: bind(lambda *a, f=f, scale=scale: f(*a, scale)) for name, f in
                 _peers(paged_decode_attention_reference, plan.use_compile).items()}
        ideal = kv_bytes + 2 * batch * q_heads * head_dim * 2
        name = (f"paged_decode B={batch} ctx={context} Hq={q_heads} Hkv={kv_heads} D={head_dim} bf16"
                + (f" [{note}]" if note else ""))
        rows += _op_rows(name, ours, peers, ideal, copy_bw, timer, plan.rounds, bw_target=0.75)
    return rows


def kv_write_gpu_rows(plan: GpuPlan, device, copy_bw: float, timer: Timer) -> list[BenchRow]:
    """write_kv_rotary (Triton) vs eager and compile, Llama-3-8B head shapes."""
    rows = []
    q_heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    inv_freq = 500000.0 ** (-torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.arange(8192, device=device).float()[:, None] * inv_freq
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    for tokens in plan.kv_write_tokens:
        gen = torch.Generator(device=device).manual_seed(tokens)
        num_blocks = max(4 * tokens // block_size, 64)
        k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
        q, k, v = qkv.split((q_heads, kv_heads, kv_heads), dim=1)
        positions = torch.randint(0, 8192, (tokens,), device=device, generator=gen)
        slots = torch.randperm(num_blocks * block_size, device=device, generator=gen)[:tokens]
        args = (k, v, positions, table, k_cache, v_cache, slots)
        ideal = tokens * (q_heads + 2 * kv_heads) * head_dim * 2 * 2  # read q,k,v; write q, k, v
        peers = {name: _bound(f, *args, q, True) for name, f in
                 _peers(write_kv_rotary_reference, plan.use_compile).items()}
        rows += _op_rows(f"write_kv_rotary T={tokens} Hq={q_heads} Hkv={kv_heads} D={head_dim} bf16",
                         _bound(write_kv_rotary, *args, q=q, check_bounds=False), peers, ideal, copy_bw, timer,
                         plan.rounds)
    return rows


def gpu_rows(quick: bool, *, device: str = "cuda", timer: Timer | None = None,
             plan: GpuPlan | None = None) -> list[BenchRow]:
    """All GPU rows: the device probes first, then each op.

    Args:
        quick: the default plan instead of :data:`FULL_PLAN`.
        device: where to run (``"cuda"``; a CPU device is accepted for smoke tests).
        timer: seconds per call of a function; default :func:`do_bench_seconds`.
        plan: sizes to run; overrides ``quick``.

    Returns:
        Rows: copy bandwidth, GEMM throughput, then the op rows.
    """
    plan = plan or (GpuPlan() if quick else FULL_PLAN)
    timer = timer or do_bench_seconds
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)
    copy_bw, gemm = measure_device(plan, torch.device(device), timer)
    rows = [BenchRow(benchmark=f"device copy bandwidth ({name})", figure="GB/s", ours=copy_bw / 1e9,
                     note=f"{plan.copy_bytes >> 20} MiB copy, read + write bytes"),
            BenchRow(benchmark=f"bf16 GEMM {plan.gemm_size}^3 ({name})", figure="TFLOP/s", ours=gemm / 1e12)]
    with torch.inference_mode():
        rows += moe_gpu_rows(plan, device, copy_bw, timer)
        rows += paged_gpu_rows(plan, device, copy_bw, timer)
        rows += kv_write_gpu_rows(plan, device, copy_bw, timer)
    return rows
