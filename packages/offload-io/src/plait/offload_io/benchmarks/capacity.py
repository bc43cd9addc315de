"""Bigger than memory: the largest decoder each model family trains inside a memory cap, with
``OffloadConfig(memory_budget=...)`` as the only offload setting.

``plait bench offload-io`` (full run) ends with these rows; ``plait bench offload-io-capacity``
runs them alone. Three families of decoders nobody wrote for plait, each of width 1024, 16 heads,
vocab 32000 and an untied head, growing in depth (12 layers: about 217M parameters):

* ``bench``: plait's tiny-llama (RMSNorm, RoPE, SwiGLU 2752);
* ``plain``: :class:`~plait.offload_io.benchmarks.plain_decoder.PlainDecoder`, an ordinary
  ``nn.ModuleList`` decoder (LayerNorm, GELU MLP 4096);
* ``hf``: transformers' ``LlamaForCausalLM`` (SwiGLU 2752), built by its own constructor.

One process (gloo, world size 1) per try, batch 1 x 128 tokens, fp32, 3 AdamW steps; a try fits
when it exits 0 inside the cap and its loss falls. The ``budget`` variant builds under
``sharded_init(placement=...)`` (construction straight to the store) with
``OffloadConfig(memory_budget=BUDGET_FRACTION, path=...)``: the budget is that fraction of the
cgroup's limit, detected by the process itself, and every other knob is the budget's choice. It
also bounds the activations: every decoder block is checkpointed
(:func:`plait.zero_sharding.checkpoint_blocks`), and for ``plain`` and ``hf`` the LM head computes
the loss with the logits in ``LOSS_CHUNKS`` sequence chunks (:func:`plait.ulysses_sp.tile_lm_head`;
tiny-llama's own forward computes the whole logits, so it keeps them). The ``memory`` variant is
plain torch with fused AdamW, everything in memory, as a user runs it.

The cap is a cgroup v1 memory controller limit when this machine has one and the process may
write it (root): the worker's shell enters the cgroup and then becomes the Python process, so
everything from its first instruction (libraries, page cache) is charged. Otherwise the peak
resident set (VmHWM) is compared with the cap, and the rows say so. The depth ladder starts at
32 layers (the size of the 400M target) and steps down through 24, 16, 12, ... until a try fits
(the quick run climbs from 4 layers while each fits). Rows per family: the
largest model; plain AdamW's in-memory peak for that model, uncapped, over the cap (target: at
least 3, i.e. it trained inside a third of plain AdamW's peak); its step time over the disk-bound
time for its bytes at the I/O engine's throughput on the same path in the same run (target: at
most 1.5). And the largest model over all families (target: at least 400M parameters).
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
SHAPE = dict(vocab=32000, dim=1024, heads=16, ffn=2752)
# Full run: start at the depth of the 400M target (32 layers: 469M-472M parameters, each family)
# and step down only when it does not fit; each try trains 3 steps of a model this size, minutes.
START, CLIMB, DESCEND = 32, (), (24, 16, 12, 8, 4, 1)
QUICK_CAP_BYTES = int(0.75 * GIB)
QUICK_SHAPE = dict(vocab=8000, dim=512, heads=8, ffn=1376)
QUICK_START, QUICK_CLIMB, QUICK_DESCEND = 4, (8, 12), (2, 1)
STEPS, BATCH, SEQ = 3, 1, 128
BUDGET_FRACTION = "0.75"  # of the cgroup's limit: the rest is activations and allocator slack
CAPACITY_TARGET = 3.0  # in-memory peak of the largest model trained / the cap
DISK_TARGET = 1.5  # step time / the disk-bound time for its bytes
LARGEST_TARGET = 400.0  # M parameters trained inside CAP_BYTES
LOSS_CHUNKS = 8  # sequence chunks of the logits in the budget variant (plain, hf)
CGROUP_ROOT = "/sys/fs/cgroup/memory"
FAMILIES = ("bench", "plain", "hf")
FAMILY_LABELS = {"bench": "the benchmark's decoder (tiny-llama)", "plain": "an ordinary nn.ModuleList decoder",
                 "hf": "HF LlamaForCausalLM"}
VARIANT_LABELS = {"memory": "plain torch AdamW, all in memory",
                  "budget": "plait ZeRO-3 + offload, memory_budget the only offload setting"}


def bytes_per_param(grad_device: str) -> tuple[int, int]:
    """(read, written) bytes per parameter per step of one rank at fp32: parameter shards read in
    forward and backward and written after the step (3 x 4); master and two moments read and
    written (2 x 12); with gradients on disk, their shards written, read for the norm and read for
    the step (3 x 4)."""
    read, write = 2 * 4 + 12, 4 + 12
    return (read + 8, write + 4) if grad_device == "nvme" else (read, write)


def run(quick: bool) -> list[BenchRow]:
    """The capacity rows (see the module docstring); ``quick`` shrinks the family and the cap."""
    cap, shape = (QUICK_CAP_BYTES, QUICK_SHAPE) if quick else (CAP_BYTES, SHAPE)
    ladder = (QUICK_START, QUICK_CLIMB, QUICK_DESCEND) if quick else (START, CLIMB, DESCEND)
    from plait.offload_io import settings
    from plait.offload_io.benchmarks import workload

    directory = tempfile.mkdtemp(prefix="plait-bench-capacity-", dir=settings.bench_directory())
    try:
        enforced = _cgroup_available()
        available, reason = workload.zero_infinity_available()
        if not available:
            return [BenchRow(benchmark="bigger than memory: plait ZeRO-Infinity", ours=float("nan"),
                             figure="largest model (M params)", note=f"not run: {reason}")]
        families = [f for f in FAMILIES if f != "hf" or _has_transformers()]
        found = {(f, "budget"): _largest(f, "budget", cap, shape, ladder, directory, enforced) for f in families}
        # plain torch at the smallest depth only: it shows the cap is below plain training at all
        found[("bench", "memory")] = _largest("bench", "memory", cap, shape, (1, (), ()), directory, enforced)
        return _rows(found, cap, shape, directory, enforced) + ([] if "hf" in families else [BenchRow(
            benchmark="bigger than memory: HF LlamaForCausalLM", ours=float("nan"), figure="largest model (M params)",
            note="not run: transformers is not installed")])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def _largest(family: str, variant: str, cap: int, shape: dict, ladder: tuple, directory: str,
             enforced: bool) -> dict | None:
    """The deepest model of the ladder that fits (or None): from ``ladder[0]`` layers up through
    ``ladder[1]`` while each fits, or down through ``ladder[2]`` until one fits."""
    start, climb, descend = ladder
    best = None
    for layers in (start, *climb):
        result = _fits(family, variant, layers, cap, shape, directory, enforced)
        if result is None:
            break
        best = result
    if best is not None or not descend:
        return best
    for layers in descend:
        best = _fits(family, variant, layers, cap, shape, directory, enforced)
        if best is not None:
            return best
    return None


def _fits(family: str, variant: str, layers: int, cap: int, shape: dict, directory: str,
          enforced: bool) -> dict | None:
    result = _try(family, variant, layers, shape, directory, cap if enforced else None)
    fits = result is not None and result["falling"] and (enforced or result["peak_rss"] <= cap)
    print(f"  capacity: {family:5s} {variant:6s} {layers:2d} layers: " +
          ("failed" if result is None else f"{result['params'] / 1e6:.0f}M params, peak "
           f"{result['peak_rss'] / GIB:.2f} GiB, step {result['step_s']:.1f} s, "
           f"{'fits' if fits else 'does not fit'}"), flush=True)
    return result if fits else None


def _try(family: str, variant: str, layers: int, shape: dict, directory: str, cap: int | None) -> dict | None:
    """One worker process (under the cgroup cap when given); its JSON, or None if it failed."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # see suite._workers
    budget = BUDGET_FRACTION if cap is not None else str(int(float(BUDGET_FRACTION) * CAP_BYTES))
    command = [sys.executable, "-m", __name__, family, variant, str(layers), json.dumps(shape), directory, budget]
    with _capped(cap) as enter:
        process = subprocess.run(enter + command, env=env, capture_output=True, text=True, timeout=3600)
    if process.returncode != 0:
        tail = (process.stderr or "").strip().splitlines()[-1:]
        print(f"  capacity: {family} {variant} {layers} layers exited {process.returncode} {tail}", flush=True)
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


def _rows(found: dict[tuple[str, str], dict | None], cap: int, shape: dict, directory: str,
          enforced: bool) -> list[BenchRow]:
    how = "cgroup v1 memory limit" if enforced else "no cgroup here: peak RSS compared with the cap"
    title = f"bigger than memory, cap {cap / GIB:.2f} GiB ({how})"
    rows, write, read = [], None, None
    for (family, variant), result in found.items():
        label = f"{title}: {FAMILY_LABELS[family]}, {VARIANT_LABELS[variant]}"
        if result is None:
            rows.append(BenchRow(benchmark=label, figure="largest model (M params)", ours=0.0,
                                 note="not even the 1-layer model fits"))
            continue
        rows.append(BenchRow(
            benchmark=label, figure="largest model (M params)", ours=result["params"] / 1e6,
            note=f"{result['layers']} layers; peak RSS {result['peak_rss'] / GIB:.2f} GiB; step "
                 f"{result['step_s']:.1f} s; losses {', '.join(f'{x:.3f}' for x in result['losses'])}"
                 + (f"; chose {result['chosen']}" if result.get("chosen") else "")))
        if variant != "budget":
            continue
        uncapped = _try(family, "memory", result["layers"], shape, directory, None)
        if uncapped is not None:
            ratio = uncapped["peak_rss"] / cap
            rows.append(BenchRow(
                benchmark=f"{title}: {FAMILY_LABELS[family]}, plain torch AdamW's peak for the same model "
                          f"({result['layers']} layers)", figure="peak RSS (GiB)", ours=uncapped["peak_rss"] / GIB,
                peer="the cap it trained in", peer_value=cap / GIB, ratio=ratio, target=f">= {CAPACITY_TARGET:g}",
                passed=ratio >= CAPACITY_TARGET, note="plain torch AdamW, run uncapped"))
        if write is None:
            write, read = _disk_throughput(directory)
        per_read, per_write = bytes_per_param(result["grad_device"])
        params = result["params"]
        bound = params * per_read / read + params * per_write / write
        rows.append(BenchRow(
            benchmark=f"{title}: {FAMILY_LABELS[family]}, step ({result['layers']} layers)", figure="time (s)",
            ours=result["step_s"], peer="disk-bound time for its bytes", peer_value=bound,
            ratio=result["step_s"] / bound, target=f"<= {DISK_TARGET:g}",
            passed=result["step_s"] / bound <= DISK_TARGET,
            note=f"{(per_read + per_write) * params / GIB:.1f} GiB per step at {read / GIB:.2f} GiB/s read, "
                 f"{write / GIB:.2f} GiB/s write (the I/O engine, same path, this run)"))
    budget = [r for (f, v), r in found.items() if v == "budget" and r is not None]
    if budget:
        best = max(budget, key=lambda r: r["params"])
        rows.append(BenchRow(
            benchmark=f"{title}: largest model trained, any family", figure="largest model (M params)",
            ours=best["params"] / 1e6, target=f">= {LARGEST_TARGET:g}", passed=best["params"] / 1e6 >= LARGEST_TARGET,
            note=f"{FAMILY_LABELS[best['family']]}, {best['layers']} layers"))
    return rows


# -- the worker process ---------------------------------------------------------------------------
def _worker(family: str, variant: str, layers: int, shape: dict, directory: str, budget: str) -> dict:
    """Build and train one model; returns what the rows need."""
    import torch
    import torch.distributed as dist

    from plait.kernels.bench import rss_bytes
    from plait.kernels.testing import global_batch

    torch.set_num_threads(2)
    model, optimizer, placement = _build(family, variant, layers, shape, directory, budget)
    params = sum(p.numel() for p in model.parameters()) if variant == "memory" else \
        sum(slot.numel for unit in model.zero_engine.units for slot in unit.slots)
    losses, times = [], []
    for step in range(STEPS):
        start = time.perf_counter()
        loss = _loss(family, model, global_batch(step, BATCH, SEQ))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    chosen, grad_device = "", "cpu"
    if placement is not None:
        config = placement.config
        grad_device = config.grad_device
        chosen = f"sub_group_size {config.sub_group_size}, grad_device {config.grad_device}, " \
                 f"I/O blocks {config.io.block_size >> 20} MiB; blocks checkpointed" + \
                 (f", loss in {LOSS_CHUNKS} chunks" if family != "bench" else "")
        placement.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"family": family, "variant": variant, "layers": layers, "params": params, "losses": losses,
            "falling": losses[-1] < losses[0], "step_s": sorted(times[1:])[len(times[1:]) // 2],
            "peak_rss": rss_bytes()[1], "chosen": chosen, "grad_device": grad_device}


def _loss(family: str, model, batch: dict):
    """The next-token loss of ``batch`` (``input_ids`` and ``labels`` shifted by one) as each
    family's forward takes it (HF shifts the labels itself; with its head tiled, the head takes
    the shifted labels)."""
    if family == "plain":
        return model(batch["input_ids"])
    if family == "hf" and hasattr(model.lm_head, "_plait_tiled_chunks"):
        ids = batch["input_ids"]
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return model.lm_head(hidden[:, :-1], ids[:, 1:])
    if family == "hf":
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    return model(**batch).loss


def _model(family: str, layers: int, shape: dict):
    """A decoder of ``family`` with ``layers`` blocks."""
    if family == "plain":
        from plait.offload_io.benchmarks.plain_decoder import PlainDecoder

        return PlainDecoder(vocab=shape["vocab"], dim=shape["dim"], layers=layers, heads=shape["heads"])
    if family == "hf":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["dim"], intermediate_size=shape["ffn"],
            num_hidden_layers=layers, num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
            tie_word_embeddings=False, max_position_embeddings=SEQ)
        return transformers.LlamaForCausalLM(config)
    from plait.kernels.testing import tiny_llama

    return tiny_llama(num_layers=layers, vocab_size=shape["vocab"], hidden_size=shape["dim"],
                      num_heads=shape["heads"], intermediate_size=shape["ffn"], max_seq_len=2 * SEQ)


def _build(family: str, variant: str, layers: int, shape: dict, directory: str, budget: str):
    import torch

    torch.manual_seed(0)
    if variant == "memory":
        model = _model(family, layers, shape)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), None
    import torch.distributed as dist

    from plait.offload_io import OffloadConfig, zero_placement
    from plait.zero_sharding import ZeroConfig, sharded_init, zero_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    placement = zero_placement(OffloadConfig(memory_budget=budget, path=os.path.join(directory, f"run-{os.getpid()}")))
    with sharded_init(placement=placement):
        model = _model(family, layers, shape)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, lr=1e-4)
    _bound_activations(family, model)
    return model, optimizer, placement


def _bound_activations(family: str, model) -> None:
    """Checkpoint every block; tile the head's loss where the family's loss goes through it."""
    from plait.ulysses_sp import tile_lm_head
    from plait.zero_sharding import checkpoint_blocks

    if family == "plain":
        from plait.offload_io.benchmarks.plain_decoder import bound_activations

        bound_activations(model, loss_chunks=LOSS_CHUNKS)  # both, and the decoder's forward uses the tiled head
        return
    checkpoint_blocks(model)
    if family == "hf":
        tile_lm_head(model.lm_head, chunks=LOSS_CHUNKS)


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5],
                             sys.argv[6])))
