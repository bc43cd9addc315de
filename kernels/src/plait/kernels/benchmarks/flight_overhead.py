"""What naming and recording a collective costs: time per all-gather with and without the flight log.

Run: ``python -m plait.kernels.benchmarks.flight_overhead [--iters N] [--rounds R]``. Two gloo
ranks all-gather a small (1 KiB) and a larger (1 MiB) shard; each round times, in turn, torch's
own call, plait's call with the store reports off (``PLAIT_COLLECTIVE_PUBLISH_S=0``: only the
ring buffer) and plait's call as shipped (labelled, with the background reports), plus one
``store.set`` per call (what publishing on the hot path would have cost). Rounds interleave
the variants so a busy machine slows all of them alike; the table shows the fastest round's
time per call (on a shared machine the median wanders by tens of percent between runs).

``--torch-fr-buffer-size 0`` turns torch's own flight recorder off in the ranks (torch 2.13 keeps
it on, 2000 entries, by default), to compare its cost with plait's.

Because gloo's own time is that noisy, the cost plait adds is also measured alone, in one
process: the flight log's bookkeeping around a call that does nothing, and one ``store.set``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.collectives import hangs
from plait.kernels.collectives.ops import _torch
from plait.kernels.testing import run_distributed

SIZES = {"1 KiB": 256, "1 MiB": 262_144}  # fp32 elements per rank


def _time(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _variants(full: torch.Tensor, shard: torch.Tensor) -> dict:
    store = dist.distributed_c10d._get_default_store()

    def plain() -> None:
        _torch["all_gather_into_tensor"](full, shard)

    def plait_named() -> None:
        collectives.all_gather_into_tensor(full, shard, name="ZeRO-3 all-gather of unit `layers.3`")

    def store_per_call() -> None:
        store.set("plait/bench/last", "ZeRO-3 all-gather of unit `layers.3`")
        _torch["all_gather_into_tensor"](full, shard)

    # torch runs first and last in every round: the two columns' gap is the noise floor.
    return {"torch": plain, "plait, ring buffer only": plait_named, "plait, as shipped": plait_named,
            "torch + store.set per call": store_per_call, "torch again": plain}


def _rank_bench(iters: int, rounds: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for size_name, numel in SIZES.items():
        shard = torch.ones(numel)
        full = torch.empty(numel * dist.get_world_size())
        samples: dict[str, list[float]] = {}
        for _ in range(rounds):
            for variant, fn in _variants(full, shard).items():
                # The first plait variant runs with the reports stopped, the second with them on.
                os.environ["PLAIT_COLLECTIVE_PUBLISH_S"] = "0" if "only" in variant else "0.5"
                if "only" in variant and hangs._publisher is not None:
                    hangs._publisher.stopped.set()
                samples.setdefault(variant, []).append(_time(fn, iters))
        out[size_name] = {variant: min(times) for variant, times in samples.items()}
    store = dist.distributed_c10d._get_default_store()
    out["alone"] = {"store.set": _time(lambda: store.set("plait/bench/x", "label"), iters)}
    return out


def bookkeeping_seconds(iters: int = 100_000) -> float:
    """Seconds the flight log adds to one labelled blocking collective (no process group needed)."""
    def noop() -> None:
        return None

    os.environ["PLAIT_COLLECTIVE_PUBLISH_S"] = "0"
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            with collectives.named("ZeRO-3 all-gather of unit `layers.3`"):
                hangs.run("all_gather", None, "world", collectives.flight.current_label(None), None, noop)
        with_log = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(iters):
            noop()
        best = min(best, (with_log - (time.perf_counter() - start)) / iters)
    return best


def main() -> None:
    """Print the median time per all-gather for each variant (rank 0's view)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--torch-fr-buffer-size", type=int, default=None,
                        help="TORCH_FR_BUFFER_SIZE for the ranks (torch's own flight recorder; 0 turns it off)")
    args = parser.parse_args()
    env = {} if args.torch_fr_buffer_size is None else {"TORCH_FR_BUFFER_SIZE": str(args.torch_fr_buffer_size)}
    results, remote = run_distributed(_rank_bench, 2, args.iters, args.rounds, timeout=600, env=env)
    results.pop("alone")
    alone = remote["alone"]
    print(f"| all-gather, 2 gloo ranks | {' | '.join(next(iter(results.values())))} |")
    print("|---" * (1 + len(next(iter(results.values())))) + "|")
    for size_name, row in results.items():
        base = row["torch"]
        cells = [f"{t * 1e6:.0f} us ({(t / base - 1) * 100:+.1f}%)" for t in row.values()]
        print(f"| {size_name} | {' | '.join(cells)} |")
    print(f"\nflight-log bookkeeping per labelled call: {bookkeeping_seconds() * 1e6:.2f} us; "
          f"one store.set from rank 1 (the store lives in rank 0): {alone['store.set'] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
