"""Peak memory per rank of building a model: plainly vs under ``sharded_init`` (``init="construct"``).

    python -m plait.zero_sharding.benchmarks.construction_memory [--world 2] [--layers 12] [--out FILE]

Builds an HF Llama (vocab 32000, dim 1024, untied head; ``--layers`` decoder layers, 219.7M
parameters at 12) in fresh gloo processes, once plainly and once under ``sharded_init``, and
prints each rank's peak RSS of the construction (``ru_maxrss``) and its time as a table; ``--out``
also writes it as JSON. Needs ``transformers``. Set ``MALLOC_MMAP_THRESHOLD_=1048576`` to measure
what is used rather than what glibc keeps after frees (the table says which was in effect).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GIB = 2**30


def _build(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                        tie_word_embeddings=False))


def _rank(rank: int, world: int, mode: str, layers: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers  # noqa: F401  (imported before the measured window)

    from plait.zero_sharding import sharded_init

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    start = time.perf_counter()
    if mode == "plain":
        model = _build(layers)
    else:
        with sharded_init():
            model = _build(layers)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put({"mode": mode, "rank": rank, "params": sum(p.numel() for p in model.parameters()),
               "rss_before_gib": before / GIB, "peak_gib": peak / GIB, "seconds": seconds})
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, layers: int) -> list[dict[str, Any]]:
    """One row per (mode, rank)."""
    rows = []
    for port, mode in enumerate(("plain", "construct"), start=29531):
        queue = mp.get_context("spawn").Queue()
        mp.spawn(_rank, args=(world, mode, layers, port, queue), nprocs=world)
        rows += sorted((queue.get() for _ in range(world)), key=lambda r: r["rank"])
    return rows


def main() -> None:
    """Command-line entry: measure, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = measure(args.world, args.layers)
    malloc = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
    print(f"construction of an HF Llama, {rows[0]['params'] / 1e6:.1f}M parameters, {args.world} gloo ranks, "
          f"MALLOC_MMAP_THRESHOLD_={malloc}")
    print("| mode | rank | RSS before (GiB) | peak RSS (GiB) | time (s) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['rank']} | {r['rss_before_gib']:.2f} | {r['peak_gib']:.2f} | {r['seconds']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "world": args.world,
                       "layers": args.layers, "malloc_mmap_threshold": malloc, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
