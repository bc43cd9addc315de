"""The two-node benchmark (``plait bench zero-sharding-nodes``): ZeRO++ where it matters, across nodes.

As root, it makes two network namespaces joined by a veth pair (:mod:`plait.kernels.benchmarks.netem`),
each a "node" of two ranks: ranks of a node talk over the namespace's loopback, the nodes over
the veth, which a ``tc`` token bucket holds to 1 Gbit/s for the second pass. In each namespace one
``torchrun --nnodes 2 --nproc-per-node 2`` agent starts its two ranks (static rendezvous on node
0's veth address). Per pass (unthrottled, then 1 Gbit/s) every rank builds all modes and
alternates their steps (:mod:`.two_node_worker`): DDP, FSDP2 (``fully_shard`` over the 4 ranks),
FSDP2 HSDP (a 2 x 2 mesh: replicate across nodes, shard inside), plait ZeRO-3 reducing in one hop
(as DeepSpeed's ZeRO-3 does: the bytes baseline) and in two hops (its default across nodes), plait hpZ alone
(secondary partition of 2), plait qwZ int8 + qgZ int4, and plait ZeRO++ (all three; qgZ in two
hops across nodes), plus, informational, ZeRO++ with qgZ's one flat all-to-all.

Figures per mode: bytes crossing nodes per measured step (the veth counters of both ends, the
barriers' share taken off: wire bytes, TCP/IP headers included; the median step, on the
unthrottled pass), median step time on each link,
and the final loss (the global batch's, every mode must learn). Targets: ZeRO++ bytes
<= 1/10 of one-hop ZeRO-3's, ZeRO++ step at 1 Gbit/s <= 0.8x DDP's, hpZ alone <= 0.70x one-hop
ZeRO-3's bytes.
Without root or iproute2 it says why and exits non-zero. DeepSpeed's ZeRO++ needs CUDA and is not
compared here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.kernels.bench import BenchRow
from plait.kernels.benchmarks import netem
from plait.zero_sharding.benchmarks.two_node_worker import MODES, ZERO3_ONE_HOP

SUITE = "zero-sharding-nodes"
NODES, PER_NODE = 2, 2
RATES = (None, "1gbit")
REFERENCE_BYTES, REFERENCE_TIME = ZERO3_ONE_HOP, "DDP"
BYTES_FIGURE, LOSS_FIGURE = "bytes crossing nodes/step", "final loss"
TARGETS = {  # (mode, figure) -> the bar on the ratio
    ("plait ZeRO++", BYTES_FIGURE): 0.1,
    ("plait ZeRO++", "step at 1 Gbit/s (ms)"): 0.8,
    ("plait hpZ", BYTES_FIGURE): 0.70,
}
QUICK_MODEL = dict(num_layers=2, vocab_size=1024)  # 2.1M parameters


def spec_for(quick: bool) -> dict[str, Any]:
    """What every rank runs: the model (tiny-llama, 8.4M fp32; quick: 2 layers, vocab 1024),
    the global batch (8 x 64 tokens, 2 sequences per rank) and the steps (5 measured: a median of
    3 moved by 30% between runs on this shared 2-core machine)."""
    return {"model": QUICK_MODEL if quick else {}, "batch": 8, "seq": 64, "warmup": 1 if quick else 2,
            "steps": 2 if quick else 5, "per_node": PER_NODE, "nodes": NODES, "modes": list(MODES),
            "timeout": 600}


def cannot_run_reason() -> str | None:
    """Why the benchmark cannot run here (not root, no ``ip``/``tc``), or ``None``."""
    return netem.unavailable_reason()


def run(quick: bool, *, modes: Sequence[str] | None = None, rates: Sequence[str | None] = RATES) -> list[BenchRow]:
    """Run the benchmark (see the module docstring).

    Args:
        quick: the 2-layer model, 1 warm-up and 2 measured steps.
        modes: a subset of :data:`~.two_node_worker.MODES` (default: all).
        rates: the links, in order (``None``: unthrottled).

    Returns:
        The rows: per mode, bytes crossing nodes, step time on each link, final loss; then the
        targets' rows are those with a ``target``.

    Raises:
        SystemExit: the namespaces cannot be made here (the message says why).
    """
    reason = cannot_run_reason()
    if reason is not None:
        raise SystemExit(f"plait bench {SUITE}: cannot run here: {reason}. It builds two network namespaces "
                         f"joined by a tc-limited veth pair, which needs root and iproute2.")
    spec = {**spec_for(quick), **({"modes": list(modes)} if modes else {})}
    results: dict[str, dict[str, Any]] = {}
    try:
        with netem.emulated_nodes(NODES, prefix="pzs") as nodes:
            for rate in rates:
                nodes.set_rate(rate)
                label = rate_label(rate)
                _say(f"link {label}: torchrun --nnodes {NODES} --nproc-per-node {PER_NODE} in namespaces "
                     f"{', '.join(nodes.namespaces)} ({len(spec['modes'])} modes, {spec['warmup']} warm-up + "
                     f"{spec['steps']} measured steps)")
                start = time.perf_counter()
                results[label] = launch(nodes, spec)
                _say(f"link {label}: done in {time.perf_counter() - start:.0f} s")
    except RuntimeError as exc:
        raise SystemExit(f"plait bench {SUITE}: cannot run here: {exc}") from None
    rows = rows_from(results, spec)
    print(summary_table(rows), flush=True)
    print(f"\n{deepspeed_note()}", flush=True)
    _write_raw(results, spec, quick)
    return rows


def rate_label(rate: str | None) -> str:
    """``"unthrottled"`` or the tc rate, e.g. ``"1gbit"``."""
    return rate or "unthrottled"


def _say(text: str) -> None:
    print(f"[{SUITE}] {text}", file=sys.stderr, flush=True)


def torchrun_argv(nodes: netem.Nodes, node: int, port: int, spec_path: str) -> list[str]:
    """The command starting node ``node``'s torchrun agent inside its namespace."""
    return nodes.command(node, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes.namespaces)),
        "--nproc-per-node", str(PER_NODE), "--node-rank", str(node), "--rdzv-backend", "static",
        "--master-addr", nodes.addresses[0], "--master-port", str(port), "--max-restarts", "0",
        "-m", "plait.zero_sharding.benchmarks.two_node_worker", spec_path,
    ])


def launch(nodes: netem.Nodes, spec: dict[str, Any]) -> dict[str, Any]:
    """Start one torchrun agent per node, echo rank 0's progress, wait; rank 0's figures or an error."""
    port = random.randint(20000, 60000)  # the namespaces are fresh: any port is free there
    with tempfile.TemporaryDirectory(prefix="plait-two-node-") as tmp:
        out = Path(tmp, "out.json")
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps({**spec, "out": str(out), "devices": list(nodes.devices)}))
        procs: list[subprocess.Popen] = []
        tails: list[list[str]] = []
        try:
            for node in range(len(nodes.namespaces)):
                env = {**os.environ, "GLOO_SOCKET_IFNAME": nodes.devices[node], "OMP_NUM_THREADS": "1",
                       "PYTHONUNBUFFERED": "1"}
                proc = subprocess.Popen(torchrun_argv(nodes, node, port, str(spec_path)), env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
                tail: list[str] = []
                threading.Thread(target=_follow, args=(proc, tail, node == 0), daemon=True).start()
                procs.append(proc)
                tails.append(tail)
            failure = _wait(procs, spec["timeout"] * 2)
        finally:  # also on Ctrl-C: no rank outlives its (deleted) namespace
            _kill(procs)
        if out.exists() and failure is None:
            return json.loads(out.read_text())
        last = next((t[-1] for t in tails if t), "")
        return {"error": f"{failure or 'no results written'}; last output: {last[:300]}", "modes": {}}


def _follow(proc: subprocess.Popen, tail: list[str], echo: bool) -> None:
    """Keep the last lines of an agent's output; echo rank 0's progress lines."""
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail.append(line)
        del tail[:-40]
        if echo and line.startswith("[two-node]"):
            _say(line[len("[two-node] "):])


def _wait(procs: list[subprocess.Popen], timeout: float) -> str | None:
    deadline, failure = time.monotonic() + timeout, None
    for proc in procs:
        try:
            if proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0 and failure is None:
                failure = f"a torchrun agent exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            failure = failure or f"timed out after {timeout:.0f} s"
            break
    _kill(procs)
    return failure


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:  # each agent leads its own session: take its ranks down with it
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _median(values: Sequence[float]) -> float:
    """The median step: a stray TCP retransmission lands in one step, not in every one."""
    return statistics.median(values) if values else float("nan")


def rows_from(results: dict[str, dict[str, Any]], spec: dict[str, Any]) -> list[BenchRow]:
    """Per mode: bytes crossing nodes/step (unthrottled pass) against one-hop ZeRO-3, step time on
    each link against DDP, and the final loss; a mode that failed is a row saying why."""
    where = f"{NODES} nodes x {PER_NODE} ranks, tiny-llama{' (2 layers, vocab 1024)' if spec['model'] else ''} fp32"
    first = results.get(rate_label(RATES[0]), {}).get("modes", {})
    rows: list[BenchRow] = []
    ref_bytes = _median(first.get(REFERENCE_BYTES, {}).get("crossing_bytes", []))
    for mode in spec["modes"]:
        got = first.get(mode, {})
        if "crossing_bytes" not in got:
            error = got.get("error") or next((r["error"] for r in results.values() if r.get("error")), "no result")
            rows.append(BenchRow(benchmark=mode, figure=BYTES_FIGURE, ours=float("nan"),
                                 note=f"could not run: {error}"))
            continue
        nbytes = _median(got["crossing_bytes"])
        later = [(label, r["modes"][mode]) for label, r in list(results.items())[1:]
                 if "crossing_bytes" in r.get("modes", {}).get(mode, {})]
        others = "; ".join(f"{label}: {_median(m['crossing_bytes']) / 1e6:.1f} MB" for label, m in later)
        steps = ", ".join(f"{b / 1e6:.1f}" for b in got["crossing_bytes"])
        resent = sum(got.get("tcp_retransmitted", []))
        rows.append(_ratio_row(mode, BYTES_FIGURE, nbytes, REFERENCE_BYTES, ref_bytes,
                               f"{where}; wire bytes, both directions, median of steps ({steps} MB; "
                               f"{resent} TCP segments resent); {others}"))
        for label, result in results.items():
            ref = result.get("modes", {}).get(REFERENCE_TIME, {}).get("seconds")
            mine = result.get("modes", {}).get(mode, {}).get("seconds")
            if mine:
                rows.append(_ratio_row(mode, f"step {_link_words(label)} (ms)", statistics.median(mine) * 1e3,
                                       REFERENCE_TIME, statistics.median(ref) * 1e3 if ref else None,
                                       f"steps {', '.join(f'{s * 1e3:.0f}' for s in mine)} ms"))
        rows.append(BenchRow(benchmark=mode, figure=LOSS_FIGURE, ours=got["final_loss"],
                             note=f"first {got['first_loss']:.4f} (mean over ranks); {got.get('route', '')}"))
    return rows


def _link_words(label: str) -> str:
    if label == "unthrottled":
        return label
    return f"at {label.replace('gbit', ' Gbit/s').replace('mbit', ' Mbit/s')}"


def _ratio_row(mode: str, figure: str, ours: float, peer: str, peer_value: float | None, note: str) -> BenchRow:
    ratio = ours / peer_value if peer_value else None
    bar = TARGETS.get((mode, figure))
    return BenchRow(benchmark=mode, figure=figure, ours=ours, peer=peer, peer_value=peer_value, ratio=ratio,
                    target="" if bar is None else f"<= {bar:g}",
                    passed=None if bar is None or ratio is None else ratio <= bar, note=note)


def summary_table(rows: Sequence[BenchRow]) -> str:
    """The README's table: one line per mode, then the targets as PASS/FAIL lines."""
    by_mode: dict[str, dict[str, BenchRow]] = {}
    for row in rows:
        by_mode.setdefault(row.benchmark, {})[row.figure] = row
    head = ("| mode | bytes crossing nodes/step | vs one-hop ZeRO-3 | step unthrottled | step at 1 Gbit/s "
            "| vs DDP at 1 Gbit/s | final loss |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for mode, got in by_mode.items():
        if mode not in MODES:
            continue
        nbytes, fast, slow, loss = (got.get(f) for f in (BYTES_FIGURE, "step unthrottled (ms)",
                                                           "step at 1 Gbit/s (ms)", LOSS_FIGURE))
        if nbytes is not None and nbytes.ratio is None and "could not run" in nbytes.note:
            lines.append(f"| {mode} | {nbytes.note} | | | | | |")
            continue
        lines.append("| " + " | ".join([
            mode, _fmt(nbytes, "MB"), _fmt_ratio(nbytes), _fmt(fast, "ms"), _fmt(slow, "ms"), _fmt_ratio(slow),
            f"{loss.ours:.4f}" if loss else "-"]) + " |")
    lines += ["", "| target | measured | result |", "|---|---|---|"]
    for row in rows:
        if row.target:
            measured = "-" if row.ratio is None else f"{row.ratio:.3f}x {row.peer}"
            verdict = {True: "PASS", False: "FAIL", None: "not measured"}[row.passed]
            lines.append(f"| {row.benchmark}: {row.figure} {row.target} x {row.peer} | {measured} | {verdict} |")
    return "\n".join(lines)


def _fmt(row: BenchRow | None, unit: str) -> str:
    if row is None or row.ours != row.ours:
        return "-"
    return f"{row.ours / 1e6:.1f} MB" if unit == "MB" else f"{row.ours:.0f} ms"


def _fmt_ratio(row: BenchRow | None) -> str:
    return "-" if row is None or row.ratio is None else f"{row.ratio:.2f}x"


def deepspeed_note() -> str:
    """Why DeepSpeed's ZeRO++ is not a row."""
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    why = "this machine has no GPU" if not gpu else "this benchmark runs the CPU/gloo path only"
    return (f"DeepSpeed ZeRO++ (zero_quantized_weights, zero_quantized_gradients, zero_hpz_partition_size) is not "
            f"compared: its quantization kernels need CUDA, and {why}.")


def _write_raw(results: dict[str, Any], spec: dict[str, Any], quick: bool) -> None:
    """Every step's figures (and plait's logical bytes by collective), where the run's JSON goes."""
    from plait.kernels.cli.bench import plot_path

    path = plot_path(SUITE, f"{SUITE}-raw", quick=quick).with_suffix(".json")
    path = path.with_name(path.name.replace(f"-{SUITE}-raw", "-raw"))  # --out X.json: X-raw.json beside it
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"spec": spec, "results": results}, indent=1) + "\n")
    _say(f"wrote every step's figures to {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m plait.zero_sharding.benchmarks.two_node RESULTS.json``: print its README table."""
    from plait.kernels.bench import read_json

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m plait.zero_sharding.benchmarks.two_node RESULTS.json")
        return 2
    rows, meta = read_json(Path(args[0]))
    print(summary_table(rows))
    print(f"\n{meta.get('date', '?')}, {meta.get('machine', '?')}, `{meta.get('command', '?')}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
