"""The ulysses-sp benchmark suite (``plait bench ulysses-sp [--quick]``).

The longest sequence that trains (forward + backward + AdamW step) with every rank's peak resident
memory under a fixed cap, 2 gloo ranks, the 27.8M-parameter Llama of :mod:`.workload`:

* for each length of a doubling series, every variant still under the cap runs one step in fresh
  processes (variants interleaved per length) and reports its ranks' peak RSS; a variant stops
  at its first length over the cap;
* rows: longest length under the cap per variant, ALST against the baseline (target >= 4x) and
  against DeepSpeed's ALST (target >= 1x); time per token at the baseline's longest length and
  the same global batch (two sequences per step: the data-parallel baseline one per rank, ALST
  two micro-batches over both sp ranks), alternating A B C A B C (target <= 1.1x); ALST with
  FPDT's chunked attention inside against ALST, in length and time (no target: an option);
* a PNG of peak memory against sequence length for every variant, the cap drawn in, written where
  the run's JSON goes (:mod:`.output`).

The cap (``CAP_GIB``) is the model states of this model (parameters, gradients, AdamW's two
moments: 0.41 GiB) plus the process's own runtime (torch + transformers: ~0.4 GiB) plus 0.4 GiB
for activations; the CPU machine cannot run the anchor's multi-GiB caps in minutes (attention
is quadratic and one core per rank computes it).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from plait.kernels.bench import BenchRow
from plait.kernels.cli.bench import plot_path
from plait.kernels.testing.distributed import run_distributed
from plait.ulysses_sp.benchmarks.workload import FPDT_CHUNK, VARIANTS, run_variant

CAP_GIB = 1.25
ALST_TARGET, DEEPSPEED_TARGET, TIME_TARGET = 4.0, 1.0, 1.1
GLOBAL_SEQUENCES = 2  # sequences per optimizer step in the timing rows: the baseline's one per rank


def run(quick: bool) -> list[BenchRow]:
    """Run the suite.

    Args:
        quick: lengths up to 8k tokens and one timing round (about 3 minutes on 2 cores) instead
            of up to 16k and two rounds.

    Returns:
        The table's rows.
    """
    lengths = [1024, 2048, 4096, 8192] + ([] if quick else [16384])
    peaks = _memory_series(lengths)
    longest = {v: max((n for n, p in peaks[v].items() if p <= CAP_GIB), default=0) for v in VARIANTS}
    rows = _length_rows(longest, lengths)
    rows += _timing_rows(longest["baseline"], rounds=1 if quick else 2)
    rows += [BenchRow(benchmark=f"peak RSS/rank, {v}, {n} tokens", figure="GiB", ours=round(p, 3),
                      note="over the cap" if p > CAP_GIB else "") for v in VARIANTS for n, p in peaks[v].items()]
    plot = _plot(peaks, quick)
    if plot:
        rows.append(BenchRow(benchmark="peak memory vs sequence length", figure="plot", ours=float(len(peaks)),
                             note=f"PNG: {Path(plot).name} (beside the results file)"))
    return rows


def _memory_series(lengths: list[int]) -> dict[str, dict[int, float]]:
    peaks: dict[str, dict[int, float]] = {v: {} for v in VARIANTS}
    alive = set(VARIANTS)
    for seq in lengths:
        for variant in VARIANTS:
            if variant not in alive:
                continue
            ranks = run_distributed(run_variant, 2, variant, seq, 1, timeout=600)
            peaks[variant][seq] = max(r["peak_rss_gib"] for r in ranks)
            print(f"ulysses-sp bench: {variant:15s} {seq:6d} tokens  peak {peaks[variant][seq]:.2f} GiB/rank",
                  flush=True)
            if peaks[variant][seq] > CAP_GIB:
                alive.discard(variant)
    return peaks


def _length_rows(longest: dict[str, int], lengths: list[int]) -> list[BenchRow]:
    top = lengths[-1]
    note = f"cap {CAP_GIB} GiB peak RSS/rank; series {lengths[0]}..{top}"
    base, alst, ds = longest["baseline"], longest["ulysses+alst"], longest["deepspeed-alst"]
    capped = " (fits the longest length tried: a lower bound)" if alst == top else ""
    rows = [BenchRow(benchmark=f"longest sequence, {v}", figure="tokens", ours=float(longest[v]), note=note)
            for v in VARIANTS]
    rows.append(BenchRow(benchmark="longest sequence, ulysses+alst vs baseline", figure="tokens", ours=float(alst),
                         peer="baseline (no SP, no tiling)", peer_value=float(base),
                         ratio=alst / base if base else None, target=f">= {ALST_TARGET}",
                         passed=(alst / base >= ALST_TARGET) if base else None, note=note + capped))
    rows.append(BenchRow(benchmark="longest sequence, ulysses+alst vs DeepSpeed ALST", figure="tokens",
                         ours=float(alst), peer="DeepSpeed 0.19.8 UlyssesSPAttentionHF + TiledMLP + "
                         "TiledFusedLogitsLoss", peer_value=float(ds), ratio=alst / ds if ds else None,
                         target=f">= {DEEPSPEED_TARGET}", passed=(alst / ds >= DEEPSPEED_TARGET) if ds else None,
                         note=note + capped))
    fpdt = longest["ulysses+alst+fpdt"]
    rows.append(BenchRow(benchmark="longest sequence, ulysses+alst+fpdt vs ulysses+alst", figure="tokens",
                         ours=float(fpdt), peer="ulysses+alst (sdpa inside)", peer_value=float(alst),
                         ratio=fpdt / alst if alst else None,
                         note=f"{note}; FPDT chunks of {FPDT_CHUNK} tokens, host = device memory on this machine"))
    return rows


def _timing_rows(seq: int, *, rounds: int) -> list[BenchRow]:
    """Throughput at the baseline's longest length, at the same global batch: every step trains two
    sequences of ``seq`` tokens, the data-parallel baseline one per rank, ALST both over the two sp
    ranks one after another (gradients accumulated, as ALST trains sequences longer than one rank
    holds); compared as a time per token (lower is better). With one sequence per step ALST would
    also pay the optimizer step and the gradient all-reduce once per sequence instead of once per
    two, a different training recipe (half the global batch), not a cost of SP or tiling. ALST with
    FPDT inside is timed in the same rounds, against ALST (no target: an option, reported)."""
    if not seq:
        return [BenchRow(benchmark="time per token at the baseline's longest length", figure="ms/1k tokens",
                         ours=float("nan"), note="the baseline fits no length of the series")]
    wall, cpu = _timed_steps(seq, rounds)
    base, alst, fpdt = (_per_k_tokens(wall[v], seq) for v in TIMED)
    base_cpu, alst_cpu, fpdt_cpu = (statistics.median(cpu[v]) for v in TIMED)
    how = (f"median of {rounds} alternating runs of 3 timed steps, {GLOBAL_SEQUENCES} sequences per step: baseline "
           f"one sequence per rank, ALST {GLOBAL_SEQUENCES} micro-batches of one sequence over both ranks")
    return [
        BenchRow(benchmark=f"time per token, {seq}-token sequences, ulysses+alst vs baseline", figure="ms/1k tokens",
                 ours=round(alst, 2), peer="baseline (data parallel, no SP, no tiling)", peer_value=round(base, 2),
                 ratio=alst / base, target=f"<= {TIME_TARGET}", passed=alst / base <= TIME_TARGET,
                 note=f"{how}; CPU time per step (what other jobs barely change) baseline {base_cpu:.3f} s, ALST "
                      f"{alst_cpu:.3f} s, {alst_cpu / base_cpu:.3f}x"),
        BenchRow(benchmark=f"time per token, {seq}-token sequences, ulysses+alst+fpdt vs ulysses+alst",
                 figure="ms/1k tokens", ours=round(fpdt, 2), peer="ulysses+alst (sdpa inside)",
                 peer_value=round(alst, 2), ratio=fpdt / alst,
                 note=f"FPDT chunks of {FPDT_CHUNK} tokens; same runs; CPU time per step FPDT {fpdt_cpu:.3f} s, "
                      f"{fpdt_cpu / alst_cpu:.3f}x ALST's"),
    ]


TIMED = ("baseline", "ulysses+alst", "ulysses+alst+fpdt")


def _timed_steps(seq: int, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each timed variant's step wall time and CPU time (slowest rank), ``rounds`` times, interleaved."""
    wall: dict[str, list[float]] = {v: [] for v in TIMED}
    cpu: dict[str, list[float]] = {v: [] for v in TIMED}
    for _ in range(rounds):  # A B C A B C: each call 4 steps, the first one dropped
        for variant in TIMED:
            micro = 1 if variant == "baseline" else GLOBAL_SEQUENCES
            ranks = run_distributed(run_variant, 2, variant, seq, 4, micro, timeout=900)
            wall[variant].append(max(r["step_s"] for r in ranks))
            cpu[variant].append(max(r["cpu_s"] for r in ranks))
    return wall, cpu


def _per_k_tokens(step_times: list[float], seq: int) -> float:
    """Milliseconds per 1k tokens from the median step time (both variants train the same tokens per step)."""
    return 1e6 * statistics.median(step_times) / (GLOBAL_SEQUENCES * seq)


def _plot(peaks: dict[str, dict[int, float]], quick: bool) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out = plot_path("ulysses-sp", "ulysses-sp-memory", quick=quick)  # where the run's JSON goes, never the cwd
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, series in peaks.items():
        ax.plot(list(series), list(series.values()), marker="o", label=variant)
    ax.axhline(CAP_GIB, color="grey", linestyle="--", label=f"cap {CAP_GIB} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, global)")
    ax.set_ylabel("peak RSS per rank (GiB)")
    ax.set_title("plait ulysses-sp: 27.8M Llama, 2 ranks, CPU")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)
