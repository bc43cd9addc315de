"""The offload-io benchmark suite (``plait bench offload-io [--quick]``).

Rows, each a ratio against a peer measured in the same run, alternating A B A B:

1. the engine's write (fsync'd) and cold read of 1 GiB (quick: 64 MiB) against a raw
   sequential ``os.write`` + ``fsync`` / ``os.readv`` loop on the same path (target >= 0.9x raw
   throughput, i.e. time ratio <= 1.11);
2. the same against ``torch.save`` (+ fsync) / ``torch.load`` (target >= 1.5x faster, time ratio
   <= 0.667);
3. a tiny-llama training step with the optimizer state on disk against fully in memory
   (target <= 1.5x), and the optimizer step alone: on disk, and in CPU memory against
   DeepSpeedCPUAdam (DeepSpeed's CPU offload optimizer) when its op is built; torch's fused CPU
   AdamW against foreach and the for-loop (why fused is the default); ZeRO-Infinity (ZeRO-3 on
   one process with parameter shards, fp32 masters and optimizer state on disk) against in memory
   when plait-zero-sharding is installed;
4. resident memory of each variant, each in its own process (target <= 0.35x);
5. (full run) bigger than memory: the largest decoder of each model family trained with
   ``memory_budget`` alone inside a memory cap
   (:mod:`plait.offload_io.benchmarks.capacity`).

Reads are cold: pages are evicted with ``posix_fadvise`` before every read (io_bench.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from plait.kernels.bench import BenchRow, TimingStats, timing_row
from plait.offload_io import io_bench, settings
from plait.offload_io.benchmarks import capacity, workload
from plait.offload_io.buffers import aligned_empty
from plait.offload_io.config import MIB, IOConfig
from plait.offload_io.engine import AsyncIOEngine

RAW_TARGET = 1 / 0.9
TORCH_TARGET = 1 / 1.5
STEP_TARGET = 1.5
RSS_TARGET = 0.35


def run(quick: bool) -> list[BenchRow]:
    """Run the suite.

    Args:
        quick: 64 MiB instead of 1 GiB, 1 warm-up and 5 timed rounds instead of 3 and 10; the
            whole suite in about a minute on 2 cores.

    Returns:
        The table's rows.
    """
    torch.set_num_threads(1 if quick else 2)
    parent = settings.bench_directory()
    directory = tempfile.mkdtemp(prefix="plait-bench-offload-", dir=parent)
    try:
        rows = _io_rows(directory, quick)
        rows += _step_rows(directory, quick)
        rows += _rss_rows(directory, quick)
        if quick:  # minutes of model builds under a cap: the full run only
            rows.append(not_run_row("bigger than memory (capacity rows)", "--quick; run `plait bench offload-io` "
                                    "or `plait bench offload-io-capacity`", figure="largest model (M params)"))
        else:
            rows += capacity.run(False)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def _interleave(fns: dict[str, Callable[[], float]], *, warmup: int, steps: int) -> dict[str, TimingStats]:
    """A B A B rounds of callables that time themselves (so eviction and setup are not counted)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            samples[name].append(fn())
    return {name: TimingStats.of(values) for name, values in samples.items()}


def _io_rows(directory: str, quick: bool) -> list[BenchRow]:
    nbytes = (64 if quick else 1024) * MIB
    warmup, steps = (1, 5) if quick else (3, 10)
    data = aligned_empty(nbytes)
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    out = aligned_empty(nbytes)
    ours_path, raw_path, torch_path = (os.path.join(directory, n) for n in ("ours.bin", "raw.bin", "torch.pt"))
    size = f"{nbytes // MIB} MiB"
    with AsyncIOEngine(IOConfig()) as engine:
        writes = _interleave({
            "ours": lambda: io_bench.engine_write(engine, data, ours_path),
            "raw": lambda: io_bench.raw_write(data, raw_path),
            "torch": lambda: io_bench.torch_save(data, torch_path),
        }, warmup=warmup, steps=steps)

        def cold(read: Callable[[], float], path: str) -> Callable[[], float]:
            return lambda: (io_bench.evict(path), read())[1]

        reads = _interleave({
            "ours": cold(lambda: io_bench.engine_read(engine, out, ours_path), ours_path),
            "raw": cold(lambda: io_bench.raw_read(out, raw_path), raw_path),
            "torch": cold(lambda: io_bench.torch_load(torch_path), torch_path),
        }, warmup=warmup, steps=steps)
        engine.read_into(out, ours_path).wait()
        ok = torch.equal(out, data)
    note = "" if ok else "DATA MISMATCH"
    rows = [
        timing_row(f"write {size} + fsync", writes["ours"], "os.write loop + fsync", writes["raw"],
                   target_ratio=RAW_TARGET),
        timing_row(f"read {size} (cold)", reads["ours"], "os.readv loop", reads["raw"], target_ratio=RAW_TARGET),
        timing_row(f"write {size} + fsync", writes["ours"], "torch.save + fsync", writes["torch"],
                   target_ratio=TORCH_TARGET),
        timing_row(f"read {size} (cold)", reads["ours"], "torch.load", reads["torch"], target_ratio=TORCH_TARGET),
    ]
    return [_with_note(row, note, fail=True) for row in rows]


def _step_rows(directory: str, quick: bool) -> list[BenchRow]:
    warmup, steps = (1, 5) if quick else (3, 10)
    variants = {"memory": None, "cpu": None, "nvme": directory}
    ds_ready, ds_reason = workload.deepspeed_cpu_adam_ready()
    if ds_ready:
        variants["deepspeed"] = None
    models = {name: workload.build_model() for name in variants}
    optimizers = {name: workload.make_optimizer(name, models[name], path) for name, path in variants.items()}
    infinity, infinity_reason = workload.zero_infinity_available()
    if infinity:
        built = workload.make_zero3_offload(workload.build_model(), "nvme", directory)
        models["infinity"], optimizers["infinity"] = built
        variants["infinity"] = directory
    ds_offload_reason = ds_reason
    if infinity:  # ours needs only plait-zero-sharding; DeepSpeed is the peer, measured when it can run
        models["zero3-cpu"], optimizers["zero3-cpu"] = workload.make_zero3_offload(workload.build_model(), "cpu")
        variants["zero3-cpu"] = None
    if infinity and ds_ready:
        try:
            optimizers["ds-offload"] = workload.DeepSpeedOffload(workload.build_model())
            models["ds-offload"] = optimizers["ds-offload"].engine
            variants["ds-offload"] = None
        except Exception as exc:  # noqa: BLE001 - the peer could not run here; the row says why
            ds_offload_reason = f"DeepSpeed ZeRO-3 offload failed to start: {type(exc).__name__}: {exc}"[:300]
    opt_times: dict[str, list[float]] = {name: [] for name in variants}
    counter = {name: 0 for name in variants}

    def stepper(name: str) -> Callable[[], float]:
        def one() -> float:
            total, opt = workload.train_step(models[name], optimizers[name], counter[name])
            counter[name] += 1
            opt_times[name].append(opt)
            return total
        return one

    timings = _interleave({name: stepper(name) for name in variants}, warmup=warmup, steps=steps)
    opt_stats = {name: TimingStats.of(values[warmup:]) for name, values in opt_times.items()}
    same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in
               zip(models["memory"].parameters(), models["nvme"].parameters(), models["cpu"].parameters()))
    for name in ("cpu", "nvme", "infinity", "zero3-cpu"):
        if name in optimizers:
            optimizers[name].close()
    model = "tiny-llama 8.4M fp32"
    rows = [
        _with_note(timing_row(f"train step, {model}, AdamW state on disk", timings["nvme"],
                              "AdamW state in memory", timings["memory"], target_ratio=STEP_TARGET),
                   "" if same else "PARAMETERS DIFFER", fail=True),
        timing_row(f"optimizer.step() alone, {model}, state on disk", opt_stats["nvme"],
                   "torch fused AdamW in memory", opt_stats["memory"]),
    ]
    if infinity:
        rows.append(_with_note(timing_row(
            f"train step, {model}, ZeRO-Infinity (ZeRO-3, 1 process): parameters, fp32 masters and AdamW state "
            "on disk", timings["infinity"], "AdamW state in memory", timings["memory"], target_ratio=STEP_TARGET),
            "every step reads each parameter shard twice (forward, backward) and each master and moment once, "
            "and writes them back"))
    else:
        rows.append(not_run_row(f"train step, {model}, ZeRO-Infinity", infinity_reason))
    label = f"{model}, ZeRO-3 (1 process), parameters, masters and AdamW state in CPU memory"
    peer = "DeepSpeed ZeRO-3, offload_param + offload_optimizer cpu (DeepSpeedCPUAdam)"
    if "zero3-cpu" in variants:
        rows.append(peer_row(f"train step, {label}", timings["zero3-cpu"], peer, timings.get("ds-offload"),
                             ds_offload_reason, target_ratio=1.0))
        rows.append(peer_row(f"optimizer step alone, {label}", opt_stats["zero3-cpu"], peer,
                             opt_stats.get("ds-offload"), ds_offload_reason, target_ratio=1.0))
    else:
        rows.append(not_run_row(f"train step, {label}", infinity_reason, peer=peer))
    rows.append(peer_row(f"optimizer.step() alone, {model}, state in CPU memory (ours)", opt_stats["cpu"],
                         "DeepSpeedCPUAdam", opt_stats.get("deepspeed"), ds_reason, target_ratio=1.0))
    rows.append(peer_row(f"optimizer.step() alone, {model}, state on disk", opt_stats["nvme"],
                         "DeepSpeedCPUAdam", opt_stats.get("deepspeed"), ds_reason))
    return rows + _cpu_adamw_rows(quick)


def peer_row(benchmark: str, ours: TimingStats, peer: str, peer_stats: TimingStats | None, reason: str | None,
             *, target_ratio: float | None = None) -> BenchRow:
    """Our timing against a peer's; a peer that could not run shows ``n/a`` and ``reason``, never a 0.

    Our own figure is measured either way.
    """
    row = timing_row(benchmark, ours, peer, peer_stats, target_ratio=target_ratio)
    if peer_stats is None:
        row = dataclasses.replace(row, peer_value=None, ratio=None, target="", passed=None,
                                  note=f"peer n/a: {reason or 'it could not run in this environment'}")
    return row


def not_run_row(benchmark: str, reason: str, *, figure: str = "time (ms)", peer: str = "") -> BenchRow:
    """A row for a measurement of ours that could not run here: no value (NaN, never a 0) and the reason."""
    return BenchRow(benchmark=benchmark, figure=figure, ours=float("nan"), peer=peer, note=f"not run: {reason}")


def _cpu_adamw_rows(quick: bool) -> list[BenchRow]:
    """torch's fused CPU AdamW against its foreach and for-loop forms on tiny-llama's shapes."""
    warmup, steps = (1, 5) if quick else (3, 10)
    shapes = [tuple(p.shape) for p in workload.build_model().parameters()]
    variants = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    params, optimizers = {}, {}
    for name, kwargs in variants.items():
        generator = torch.Generator().manual_seed(0)
        params[name] = [torch.randn(s, generator=generator) for s in shapes]
        for p in params[name]:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizers[name] = torch.optim.AdamW(params[name], lr=1e-3, **kwargs)

    def timed(name: str) -> Callable[[], float]:
        def one() -> float:
            start = time.perf_counter()
            optimizers[name].step()
            return time.perf_counter() - start
        return one

    stats = _interleave({name: timed(name) for name in variants}, warmup=warmup, steps=steps)
    bitwise = all(torch.equal(a, b) for a, b in zip(params["fused"], params["for-loop"]))
    note = "fused is bitwise equal to the for-loop" if bitwise else (
        "fused differs from the for-loop in the last bits (different op order); the offloaded optimizer is "
        "compared with fused in memory")
    label = "AdamW step on CPU, tiny-llama shapes, fused=True (our default)"
    return [timing_row(label, stats["fused"], "foreach=True", stats["foreach"], target_ratio=1.0),
            _with_note(timing_row(label, stats["fused"], "for-loop", stats["for-loop"], target_ratio=1.0), note)]


def _rss_rows(directory: str, quick: bool) -> list[BenchRow]:
    steps = 2 if quick else 5
    variants = ("memory", "nvme", "infinity") if workload.zero_infinity_available()[0] else ("memory", "nvme")
    found = _workers(variants, steps, directory)
    if any(v is None for v in found.values()):
        return [not_run_row("resident memory", "a worker process failed", figure="RSS")]
    memory, nvme = found["memory"], found["nvme"]
    rows = []
    for key, label in (("rss_after", "RSS after training above imports (MiB)"),
                       ("rss_peak", "peak RSS above imports (MiB)")):
        peer = (memory[key] - memory["rss_imports"]) / MIB
        for name, title in (("nvme", "AdamW state on disk"),
                            ("infinity", "ZeRO-Infinity: parameters, masters and state on disk")):
            if name in found:
                ours = (found[name][key] - found[name]["rss_imports"]) / MIB
                rows.append(_ratio_row(f"tiny-llama, {title}, {steps} steps", label, ours, peer))
    rows.append(_ratio_row(f"tiny-llama, AdamW state on disk, {steps} steps", "optimizer-state bytes in memory (MiB)",
                           nvme["optimizer_state_bytes"] / MIB, memory["optimizer_state_bytes"] / MIB,
                           note="the store's slots (3 sub-groups: read, step, write) against all of AdamW's state"))
    rows.append(_ratio_row(f"tiny-llama, AdamW state on disk, {steps} steps", "model-state bytes (MiB)",
                           nvme["model_state_bytes"] / MIB, memory["model_state_bytes"] / MIB,
                           note="params + grads + optimizer state (+ store slots): params and grads stay "
                                "resident on a CPU-only machine"))
    if "infinity" in found:
        rows.append(_ratio_row(f"tiny-llama, ZeRO-Infinity, {steps} steps", "model-state bytes (MiB)",
                               found["infinity"]["model_state_bytes"] / MIB, memory["model_state_bytes"] / MIB,
                               note="resident units + fp32 gradient shards + the store's slots; parameter "
                                    "shards, masters and moments are in files"))
    return rows


def _ratio_row(benchmark: str, figure: str, ours: float, peer: float, note: str = "") -> BenchRow:
    ratio = ours / peer if peer else None
    return BenchRow(benchmark=benchmark, figure=figure, ours=ours, peer="state in memory", peer_value=peer,
                    ratio=ratio, target=f"<= {RSS_TARGET:g}",
                    passed=None if ratio is None else ratio <= RSS_TARGET, note=note)


def _workers(variants: tuple[str, ...], steps: int, directory: str) -> dict[str, dict | None]:
    """Run one process per variant, side by side (memory figures are per process, not timings)."""
    module = "plait.offload_io.benchmarks.workload"
    # glibc's mmap threshold fixed (the same for every variant): a freed large buffer goes back to
    # the OS. Left dynamic, glibc raises the threshold after the first free of a big block and
    # keeps later ones in its heap, so a process that frees and re-allocates buffers every module
    # (ZeRO-3's gathers) shows ~300 MiB of RSS it does not use; jemalloc/tcmalloc behave like this.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MIB)}
    running = {v: subprocess.Popen([sys.executable, "-m", module, v, str(steps), directory], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in variants}
    found: dict[str, dict | None] = {}
    for variant, process in running.items():
        try:
            stdout, stderr = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        if process.returncode != 0:
            print(f"workload {variant} failed (exit {process.returncode}):\n{stderr[-2000:]}")
            found[variant] = None
        else:
            found[variant] = json.loads(stdout.strip().splitlines()[-1])
    return found


def _with_note(row: BenchRow, extra: str, *, fail: bool = False) -> BenchRow:
    if not extra:
        return row
    return dataclasses.replace(row, note=f"{row.note}; {extra}" if row.note else extra,
                               passed=False if fail else row.passed)
