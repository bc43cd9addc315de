"""The onebit-optim benchmark suite (``plait bench onebit-optim [--quick]``).

Two ranks (W=2) train the same tiny-llama LM (26.3M parameters; quick: 5.3M; one sequence of 64
tokens per rank and step: the bandwidth-bound regime these optimizers are for, see ``_spec``) with DDP +
AdamW, DDP + torch's fp16-compression and PowerSGD comm hooks, and plait's 1-bit Adam, 0/1 Adam
and 1-bit LAMB, over an emulated link: two network namespaces joined by a veth pair with a ``tc``
rate limit (1 Gbit/s, 100 Mbit/s, and unthrottled: the compute floor), gloo over TCP between
them (:mod:`.netem`; as root). Without namespaces the suite says why and runs on loopback only.

Rows, per link: seconds per step after warm-up (alternating blocks, median with p10/p90) and
ledger volume per step, each against DDP + AdamW in the same run (the ZeRO rows, at 1 Gbit/s and
on the floor link: ``zero1_*`` / ``zero2_*`` against ZeRO + AdamW of the same stage, launched
together per stage; ZeRO + AdamW itself against DDP + AdamW); the communication time
``step - floor`` against DDP's; and the peers that cannot run, with the reason. A PNG of loss
against each variant's own training time is written where the run's JSON goes (:mod:`.output`).

PowerSGD runs in a launch of its own, because a PowerSGD failure inside gloo can take its
process down with it (torch 2.13's hook aborted on gloo/CPU in an earlier probe); its ratio is
then against DDP + AdamW from the main launch, not alternated with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from plait.kernels.bench import BenchRow, TimingStats
from plait.kernels.cli.bench import plot_path
from plait.onebit_optim.benchmarks import netem
from plait.onebit_optim.benchmarks.worker import ONEBIT, VARIANTS, ZERO_VARIANTS

REFERENCE = "ddp_adamw"
SPEEDUP_TARGET = {"onebit_adam": 1 / 3, "zero_one_adam": 1 / 3}  # >= 3x faster per step at 1 Gbit/s
BYTES_TARGET = 1 / 20
COMM_TARGET = 0.1  # communication time (step - floor) cut >= 10x
RATES = ("1gbit", "100mbit", None)
ZERO_RATES = ("1gbit", None)  # ZeRO rows: the target's link and the floor (100 Mbit/s: not run, its length)


def _spec(quick: bool) -> dict[str, Any]:
    model = (dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688, max_seq_len=128)
             if quick else
             dict(vocab_size=4096, hidden_size=512, num_layers=7, num_heads=8, intermediate_size=1376, max_seq_len=128))
    # One warm-up block: 1-bit Adam/LAMB freeze after step 2, 0/1 Adam after step 4 (worker.onebit_optimizer);
    # three timed blocks of 4 steps per variant and link. A global batch of 2 x 64 tokens (one
    # sequence per rank): these optimizers are for bandwidth-bound training, where communication is
    # most of a step. With 4 x 64 a step's compute on one core per rank (about 0.7 s forward and
    # backward, quiet) already covers most of DDP's 105 MB all-reduce at 1 Gbit/s (overlapped with
    # backward), so no optimizer could be much faster than DDP there; the table's "ceiling
    # DDP/floor" says how much faster than DDP any variant can be on each link.
    return {"model": model, "seq": 64, "batch": 2, "block": 4, "warmup_blocks": 1, "blocks": 3,
            "timeout": 900, "threads": 1}


def run(quick: bool) -> list[BenchRow]:
    """Run the suite.

    Args:
        quick: a 5.3M-parameter model instead of 26.3M.

    Returns:
        The table's rows.
    """
    spec = _spec(quick)
    main_variants = [v for v in VARIANTS if v != "ddp_powersgd"]
    reason = netem.unavailable_reason()
    results: dict[str, dict[str, Any]] = {}
    if reason is None:
        try:
            with netem.emulated_link() as link:
                for rate in _progress(RATES):
                    link.set_rate(rate)
                    label = rate or "unthrottled veth"
                    results[label] = _launch(link, spec, main_variants)
                    if rate is not None:
                        results[label].update(_launch(link, spec, ["ddp_powersgd"]))
                    if rate in ZERO_RATES:
                        results[label].update(_zero_launches(link, spec))
        except RuntimeError as exc:
            reason = str(exc)
    if reason is not None:
        results = {"loopback": {**_launch(None, spec, main_variants), **_launch(None, spec, ["ddp_powersgd"]),
                                **_zero_launches(None, spec)}}
    rows = _rows(results, reason)
    _plot(results, quick=quick)
    return rows


def _progress(items):
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="onebit-optim links", disable=not sys.stderr.isatty())


def _launch(link: netem.Link | None, spec: dict[str, Any], variants: list[str]) -> dict[str, Any]:
    """Start both ranks (in their namespaces), wait, and return rank 0's per-variant results."""
    addr = link.addresses[0] if link else "127.0.0.1"
    port = random.randint(20000, 60000)
    with tempfile.TemporaryDirectory(prefix="plait-onebit-bench-") as tmp:
        out = Path(tmp, "out.json")
        procs = []
        for rank in range(2):
            rank_spec = {**spec, "rank": rank, "world": 2, "addr": addr, "port": port, "out": str(out),
                         "variants": variants}
            argv = [sys.executable, "-m", "plait.onebit_optim.benchmarks.worker", json.dumps(rank_spec)]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.devices[rank] if link else "lo"}
            log = open(Path(tmp, f"rank{rank}.log"), "w")  # noqa: SIM115 - closed with the directory
            procs.append(subprocess.Popen(link.command(rank, argv) if link else argv, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        failure = None
        for proc in procs:
            try:
                if proc.wait(timeout=spec["timeout"]) != 0:
                    failure = f"a rank exited with {proc.returncode}"
            except subprocess.TimeoutExpired:
                failure = f"timed out after {spec['timeout']} s"
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if out.exists():
            return json.loads(out.read_text())
        tail = Path(tmp, "rank0.log").read_text().strip().splitlines()[-1:] or [""]
        return {name: {"blocks": [], "error": f"{failure}: {tail[0][:200]}"} for name in variants}


def _zero_launches(link: netem.Link | None, spec: dict[str, Any]) -> dict[str, Any]:
    """One launch per ZeRO stage: ZeRO + AdamW and the three 1-bit optimizers composed with it,
    alternating (their ratios are against ZeRO + AdamW of the same launch)."""
    out: dict[str, Any] = {}
    for stage in (1, 2):
        out.update(_launch(link, spec, [v for v in ZERO_VARIANTS if v.startswith(f"zero{stage}_")]))
    return out


def _reference_of(name: str) -> tuple[str, str]:
    """``(variant, label)`` a variant's ratios are against: ZeRO + AdamW of its stage for the ZeRO
    1-bit variants, DDP + AdamW for the others."""
    if name in ZERO_VARIANTS and not name.endswith("_adamw"):
        return f"{name[:6]}adamw", f"ZeRO-{name[4]} + AdamW"
    return REFERENCE, "DDP + AdamW"


def _per_step(result: dict[str, Any], spec_block: int = 4) -> TimingStats | None:
    timed = [b for b in result.get("blocks", []) if b["timed"]]
    return TimingStats.of([b["seconds"] / len(b["losses"]) for b in timed]) if timed else None


def _bytes_per_step(result: dict[str, Any]) -> float | None:
    timed = [b for b in result.get("blocks", []) if b["timed"]]
    return sum(b["bytes"] for b in timed) / sum(len(b["losses"]) for b in timed) if timed else None


def _rows(results: dict[str, dict[str, Any]], reason: str | None) -> list[BenchRow]:
    rows = []
    floor_link = results.get("unthrottled veth", {})
    floor = _per_step(floor_link.get(REFERENCE, {}))
    for link, by_variant in results.items():
        ref = _per_step(by_variant.get(REFERENCE, {}))
        ref_bytes = _bytes_per_step(by_variant.get(REFERENCE, {}))
        numel = by_variant.get(REFERENCE, {}).get("numel", 0)
        where = f"W=2, {numel / 1e6:.1f}M params, {link}" + (f" ({reason})" if reason else "")
        for name in (v for v in (*VARIANTS, *ZERO_VARIANTS) if v in by_variant):  # not every link runs all
            peer, label = _reference_of(name)
            if peer != REFERENCE:
                peer_result = by_variant.get(peer, {})
                rows += _variant_rows(name, by_variant[name], _per_step(peer_result), _bytes_per_step(peer_result),
                                      None, link, where, peer=label)
                continue
            rows += _variant_rows(name, by_variant.get(name, {}), ref, ref_bytes, floor, link, where)
        if "onebit_adam" in by_variant:
            rows.append(BenchRow(benchmark=f"onebit_adam step, {where}", figure="time/step (ms)",
                                 ours=_ms(_per_step(by_variant["onebit_adam"])), peer="DeepSpeed OnebitAdam",
                                 note=_deepspeed_reason()))
    return rows


def _variant_rows(name: str, result: dict[str, Any], ref: TimingStats | None, ref_bytes: float | None,
                  floor: TimingStats | None, link: str, where: str, *, peer: str = "DDP + AdamW") -> list[BenchRow]:
    if name == REFERENCE:
        stats = _per_step(result)
        return [BenchRow(benchmark=f"{name} step, {where}", figure="time/step (ms)", ours=_ms(stats),
                         note=_spread(stats) + f"; {_bytes_per_step(result) or 0:.4g} bytes/step")]
    stats, nbytes = _per_step(result), _bytes_per_step(result)
    if stats is None:
        return [BenchRow(benchmark=f"{name} step, {where}", figure="time/step (ms)", ours=float("nan"),
                         peer=peer, note=f"could not run: {result.get('error', 'no result')}")]
    ratio = stats.median / ref.median if ref else None
    target = SPEEDUP_TARGET.get(name) if link == "1gbit" else None
    rows = [BenchRow(benchmark=f"{name} step, {where}", figure="time/step (ms)", ours=_ms(stats),
                     peer=peer, peer_value=_ms(ref), ratio=ratio,
                     target="" if target is None else f"<= {target:.3g}",
                     passed=None if target is None or ratio is None else ratio <= target, note=_spread(stats))]
    if nbytes is not None and ref_bytes:
        onebit = name in ONEBIT  # under ZeRO the exact parameter gather stays: no 1/20 target there
        rows.append(BenchRow(benchmark=f"{name} bytes, {where}", figure="bytes/step", ours=nbytes,
                             peer=peer, peer_value=ref_bytes, ratio=nbytes / ref_bytes,
                             target=f"<= {BYTES_TARGET:g}" if onebit else "",
                             passed=(nbytes / ref_bytes <= BYTES_TARGET) if onebit else None,
                             note="ledger volume after warm-up (an all-reduce counts twice: RS + AG)"))
    if floor is not None and ref is not None and link != "unthrottled veth" and name in SPEEDUP_TARGET:
        ours_comm, ddp_comm = stats.median - floor.median, ref.median - floor.median
        rows.append(BenchRow(benchmark=f"{name} communication time (step - floor), {where}", figure="ms/step",
                             ours=ours_comm * 1e3, peer="DDP + AdamW", peer_value=ddp_comm * 1e3,
                             ratio=ours_comm / ddp_comm if ddp_comm > 0 else None, target=f"<= {COMM_TARGET:g}",
                             passed=ddp_comm > 0 and ours_comm / ddp_comm <= COMM_TARGET,
                             note=f"floor = DDP + AdamW on the unthrottled veth, {floor.median * 1e3:.4g} ms; "
                                  f"ceiling DDP/floor = {ref.median / floor.median:.3g}x"))
    return rows


def _ms(stats: TimingStats | None) -> float:
    return stats.median * 1e3 if stats else float("nan")


def _spread(stats: TimingStats | None) -> str:
    return f"p10/p90 {stats.p10 * 1e3:.4g}/{stats.p90 * 1e3:.4g} ms" if stats else ""


def _deepspeed_reason() -> str:
    try:
        present = importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is not None
    except ModuleNotFoundError:
        return "peer unavailable: deepspeed is not installed"
    if present:
        return "peer not run: deepspeed's OnebitAdam needs a DeepSpeed engine and CUDA (cupy/NCCL backends)"
    return "peer unavailable: this DeepSpeed no longer ships OnebitAdam (deepspeed.runtime.fp16.onebit is gone)"


def _plot(results: dict[str, dict[str, Any]], *, quick: bool) -> Path | None:
    """Loss against each variant's cumulative training time, one panel per link, as a PNG written
    where the run's JSON goes (:func:`plait.kernels.cli.bench.plot_path`: never into the checkout by default)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (link, by_variant) in zip(axes[0], results.items()):
        for name, result in by_variant.items():
            elapsed, xs, ys = 0.0, [], []
            for block in result.get("blocks", []):
                for loss in block["losses"]:
                    elapsed += block["seconds"] / len(block["losses"])
                    xs.append(elapsed)
                    ys.append(loss)
            if xs:
                ax.plot(xs, ys, label=name)
        ax.set(title=f"W=2, {link}", xlabel="training time (s)", ylabel="loss (rank 0)")
        ax.legend(fontsize=7)
    path = plot_path("onebit-optim", "onebit-optim-loss-vs-time", quick=quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"onebit-optim bench: wrote the loss-vs-time plot to {path}", flush=True)
    return path
