"""Bigger than memory: the largest decoder each variant trains inside a memory cap.

``plait bench offload-io`` (full run) ends with these rows; ``plait bench offload-io-capacity``
runs them alone. The model family is the issue's decoder: tiny-llama with vocab 32000, width
1024, 16 heads, SwiGLU 2752, an untied head, and a growing number of layers (12 layers: 217M
parameters). One process (gloo, world size 1) per try, batch 1 x 128 tokens, fp32, 3 AdamW
steps; a try fits when it exits 0 inside the cap and its loss falls. Variants:

* ``memory``: plain torch, fused AdamW, everything in memory;
* ``cpu``: plait ZeRO-3 with ZeRO-Offload (masters and AdamW state in CPU memory);
* ``infinity``: plait ZeRO-3 with ZeRO-Infinity (parameter shards, fp32 masters, AdamW state and
  gradient shards in files: ``param_device``/``device``/``grad_device="nvme"``).

The cap is a cgroup v1 memory controller limit when this machine has one and the process may
write it (root); otherwise the peak resident set (VmHWM) is compared with the cap, and the rows
say so. The depth ladder stops at a variant's first failure. The in-memory peak of the largest
model ZeRO-Infinity trained is measured uncapped (the target: at least 3x the cap), and its step
time is set against the disk-bound time for its bytes per step at the throughput measured on the
same path in the same run (the target: at most 2x).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from plait.kernels.bench import BenchRow

GIB = 1 << 30
CAP_BYTES = int(1.25 * GIB)
SHAPE = dict(vocab_size=32000, hidden_size=1024, num_heads=16, intermediate_size=2752, max_seq_len=256)
LADDER = (1, 2, 4, 6, 8, 12, 16)
QUICK_CAP_BYTES = int(0.75 * GIB)
QUICK_SHAPE = dict(vocab_size=8000, hidden_size=512, num_heads=8, intermediate_size=1376, max_seq_len=256)
QUICK_LADDER = (1, 2, 4, 8)
STEPS, BATCH, SEQ = 3, 1, 128
SUB_GROUP_SIZE = 1 << 20
CAPACITY_TARGET = 3.0  # in-memory peak of the largest model trained / the cap
DISK_TARGET = 2.0  # step time / the disk-bound time for its bytes
# Bytes moved per parameter per ZeRO-Infinity step at fp32 (one rank): parameter shards read in
# forward and backward and written after the step (3 x 4); master and two moments read and
# written (2 x 12); gradient shards written, read for the norm and read for the step (3 x 4).
READ_BYTES_PER_PARAM, WRITE_BYTES_PER_PARAM = 2 * 4 + 12 + 2 * 4, 4 + 12 + 4
CGROUP_ROOT = "/sys/fs/cgroup/memory"
VARIANTS = ("memory", "cpu", "infinity")
LABELS = {"memory": "plain torch AdamW, all in memory", "cpu": "plait ZeRO-Offload (state in CPU memory)",
          "infinity": "plait ZeRO-Infinity (params, masters, state, grads on disk)"}


def run(quick: bool) -> list[BenchRow]:
    """The capacity rows (see the module docstring); ``quick`` shrinks the family and the cap."""
    cap, shape, ladder = (QUICK_CAP_BYTES, QUICK_SHAPE, QUICK_LADDER) if quick else (CAP_BYTES, SHAPE, LADDER)
    from plait.offload_io import settings
    from plait.offload_io.benchmarks import workload

    directory = tempfile.mkdtemp(prefix="plait-bench-capacity-", dir=settings.bench_directory())
    try:
        enforced = _cgroup_available()
        available, reason = workload.zero_infinity_available()
        variants = VARIANTS if available else ("memory",)
        found = {variant: _largest(variant, cap, shape, ladder, directory, enforced) for variant in variants}
        rows = _rows(found, cap, shape, directory, enforced)
        if not available:
            rows.append(BenchRow(benchmark="bigger than memory: plait ZeRO-Offload / ZeRO-Infinity", ours=float("nan"),
                                 figure="largest model (M params)", note=f"not run: {reason}"))
        return rows
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _largest(variant: str, cap: int, shape: dict, ladder: tuple[int, ...], directory: str,
             enforced: bool) -> dict | None:
    """Climb the depth ladder until a try does not fit; the last one that did (or None)."""
    best = None
    for layers in ladder:
        result = _try(variant, layers, shape, directory, cap if enforced else None)
        fits = result is not None and result["falling"] and (enforced or result["peak_rss"] <= cap)
        print(f"  capacity: {variant:8s} {layers:2d} layers: " +
              ("failed" if result is None else f"{result['params'] / 1e6:.0f}M params, peak "
               f"{result['peak_rss'] / GIB:.2f} GiB, {'fits' if fits else 'does not fit'}"), flush=True)
        if not fits:
            break
        best = result
    return best


def _try(variant: str, layers: int, shape: dict, directory: str, cap: int | None) -> dict | None:
    """One worker process (under the cgroup cap when given); its JSON, or None if it failed."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # see suite._workers
    command = [sys.executable, "-m", __name__, variant, str(layers), json.dumps(shape), directory]
    with _capped(cap) as enter:
        process = subprocess.run(enter + command, env=env, capture_output=True, text=True, timeout=1800)
    if process.returncode != 0:
        return None
    return json.loads(process.stdout.strip().splitlines()[-1])


def _cgroup_available() -> bool:
    """Whether a cgroup v1 memory limit can be set here (root and a mounted memory controller)."""
    return os.path.isdir(CGROUP_ROOT) and os.access(CGROUP_ROOT, os.W_OK)


@contextlib.contextmanager
def _capped(cap: int | None) -> Iterator[list[str]]:
    """A command prefix that runs a process inside a fresh cgroup limited to ``cap`` bytes (no
    prefix when ``cap`` is None); the cgroup is removed afterwards."""
    if cap is None:
        yield []
        return
    group = os.path.join(CGROUP_ROOT, f"plait-capacity-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as handle:
            handle.write(str(cap))
        # The shell enters the cgroup, then becomes the worker (exec keeps the pid).
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(group)


def _disk_throughput(directory: str) -> tuple[float, float]:
    """(write, cold read) bytes per second of the I/O engine on ``directory``, 256 MiB each."""
    from plait.offload_io import io_bench
    from plait.offload_io.buffers import aligned_empty
    from plait.offload_io.config import IOConfig
    from plait.offload_io.engine import AsyncIOEngine

    size = 256 << 20
    path = os.path.join(directory, "throughput.bin")
    data = aligned_empty(size)
    with AsyncIOEngine(IOConfig()) as engine:
        start = time.perf_counter()
        engine.write(data, path).wait()
        write = size / (time.perf_counter() - start)
        io_bench.evict(path)
        start = time.perf_counter()
        engine.read_into(data, path).wait()
        read = size / (time.perf_counter() - start)
    os.remove(path)
    return write, read


def _rows(found: dict[str, dict | None], cap: int, shape: dict, directory: str, enforced: bool) -> list[BenchRow]:
    how = "cgroup v1 memory limit" if enforced else "no cgroup here: peak RSS compared with the cap"
    title = f"bigger than memory, cap {cap / GIB:.2f} GiB ({how})"
    rows = []
    for variant in found:
        result = found[variant]
        if result is None:
            rows.append(BenchRow(benchmark=f"{title}: {LABELS[variant]}", figure="largest model (M params)",
                                 ours=0.0, note="not even the 1-layer model fits"))
            continue
        rows.append(BenchRow(
            benchmark=f"{title}: {LABELS[variant]}", figure="largest model (M params)", ours=result["params"] / 1e6,
            note=f"{result['layers']} layers; peak RSS {result['peak_rss'] / GIB:.2f} GiB; step "
                 f"{result['step_s']:.1f} s; losses {', '.join(f'{x:.3f}' for x in result['losses'])}"))
    infinity = found.get("infinity")
    if infinity is None:
        return rows
    uncapped = _try("memory", infinity["layers"], shape, directory, None)
    if uncapped is not None:
        ratio = uncapped["peak_rss"] / cap
        rows.append(BenchRow(
            benchmark=f"{title}: in-memory peak of ZeRO-Infinity's largest model ({infinity['layers']} layers)",
            figure="peak RSS (GiB)", ours=uncapped["peak_rss"] / GIB, peer="the cap", peer_value=cap / GIB,
            ratio=ratio, target=f">= {CAPACITY_TARGET:g}", passed=ratio >= CAPACITY_TARGET,
            note="plain torch AdamW, run uncapped"))
    write, read = _disk_throughput(directory)
    params = infinity["params"]
    bound = params * READ_BYTES_PER_PARAM / read + params * WRITE_BYTES_PER_PARAM / write
    rows.append(BenchRow(
        benchmark=f"{title}: ZeRO-Infinity step ({infinity['layers']} layers)", figure="time (s)",
        ours=infinity["step_s"], peer="disk-bound time for its bytes", peer_value=bound,
        ratio=infinity["step_s"] / bound, target=f"<= {DISK_TARGET:g}",
        passed=infinity["step_s"] / bound <= DISK_TARGET,
        note=f"{(READ_BYTES_PER_PARAM + WRITE_BYTES_PER_PARAM) * params / GIB:.1f} GiB per step at "
             f"{read / GIB:.2f} GiB/s read, {write / GIB:.2f} GiB/s write (the I/O engine, same path, this run)"))
    return rows


# -- the worker process ---------------------------------------------------------------------------
def _worker(variant: str, layers: int, shape: dict, directory: str) -> dict:
    """Build and train one model; returns what the rows need."""
    import torch
    import torch.distributed as dist

    from plait.kernels.bench import rss_bytes
    from plait.kernels.testing import global_batch

    torch.set_num_threads(2)
    model, optimizer, placement = _build(variant, layers, shape, directory)
    params = sum(p.numel() for p in model.parameters()) if variant == "memory" else \
        sum(slot.numel for unit in model.zero_engine.units for slot in unit.slots)
    losses, times = [], []
    for step in range(STEPS):
        start = time.perf_counter()
        batch = global_batch(step, BATCH, SEQ)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    if placement is not None:
        placement.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"variant": variant, "layers": layers, "params": params, "losses": losses,
            "falling": losses[-1] < losses[0], "step_s": sorted(times[1:])[len(times[1:]) // 2],
            "peak_rss": rss_bytes()[1]}


def _build(variant: str, layers: int, shape: dict, directory: str):
    import torch

    from plait.kernels.testing import tiny_llama

    torch.manual_seed(0)
    if variant == "memory":
        model = tiny_llama(num_layers=layers, **shape)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), None
    import torch.distributed as dist

    from plait.offload_io import OffloadConfig, zero_placement
    from plait.zero_sharding import ZeroConfig, sharded_init, zero_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    on_disk = variant == "infinity"
    # sub_group_size 1M elements: the store's three slots hold 36 MiB (master and two moments).
    config = OffloadConfig(device="nvme" if on_disk else "cpu", path=os.path.join(directory, f"run-{os.getpid()}"),
                           param_device="nvme" if on_disk else "none", grad_device="nvme" if on_disk else "cpu",
                           sub_group_size=SUB_GROUP_SIZE)
    placement = zero_placement(config)
    with sharded_init():
        model = tiny_llama(num_layers=layers, **shape)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, lr=1e-4)
    return model, optimizer, placement


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])))
