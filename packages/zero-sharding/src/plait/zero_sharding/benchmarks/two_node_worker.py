"""One rank of the two-node benchmark (started by torchrun inside a node's network namespace).

Run as ``python -m plait.zero_sharding.benchmarks.two_node_worker SPEC.json`` under
``torchrun --nnodes N --nproc-per-node K`` (see :mod:`.two_node`). Every mode (DDP, FSDP2, FSDP2
HSDP, plait ZeRO-3 and the ZeRO++ variants) is built in this process from the same seed, and
their steps alternate (A B C ... A B C, shared/benchmarks.md), so the machine's noise falls on
all of them alike.

Each measured step is bracketed by barriers: ``barrier; read counters; barrier; step; barrier;
read counters``. The counters are the bytes each node's end of the inter-node link has sent
(read by the node's local rank 0 from its namespace's sysfs), so their difference summed over
nodes is what crossed between nodes during that step, TCP/IP headers included, plus the
barriers' few packets, which are measured alone (the same bracket around nothing) and
subtracted. TCP retransmissions (``RetransSegs`` of each namespace) are recorded beside: a
loaded 2-core machine delays ACKs past the retransmission timer now and then, and the resent
segments are real wire bytes that land in whichever step is running (the suite reports the
median step). Time is rank 0's clock from the barrier before the step to the one after (the
slowest rank's step). Rank 0 writes every mode's figures to ``SPEC["out"]``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.benchmarks.netem import interface_tx_bytes
from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import global_batch, rank_slice, tiny_llama

ONE_HOP = "plait ZeRO++, 1-hop qgZ"  # informational: ZeRO++ with the flat (one all-to-all) qgZ
# ZeRO-3 reducing in one hop over all ranks, as DeepSpeed's ZeRO-3 does: the baseline ZeRO++'s
# byte cuts are stated against (plain plait ZeRO-3 reduces in two hops across nodes by default).
ZERO3_ONE_HOP = "plait ZeRO-3, one-hop reduce"
MODES = ("DDP", "FSDP2", "FSDP2 HSDP", ZERO3_ONE_HOP, "plait ZeRO-3", "plait hpZ", "plait qwZ+qgZ", "plait ZeRO++",
         ONE_HOP)
OPTIMIZER = dict(lr=1e-3, weight_decay=0.01)  # the paired benchmark's AdamW options


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The benchmark model, from seed 0 (identical on every rank)."""
    torch.manual_seed(0)
    return tiny_llama(**spec.get("model", {}))


def _fsdp2(spec: dict[str, Any], hsdp: bool) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, per_node = dist.get_world_size(), spec["per_node"]
    # HSDP: replicate across nodes (dim 0), shard inside a node (dim 1: consecutive ranks).
    mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard")) \
        if hsdp else init_device_mesh("cpu", (world,))
    model = build_model(spec)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), **OPTIMIZER)


def zeropp_settings(mode: str, per_node: int) -> dict[str, Any] | None:
    """The :class:`~plait.zero_sharding.zeropp.ZeroPPConfig` fields of a plait mode (``None``: plain ZeRO-3).

    hpZ's partition is ``"auto"`` (the ranks per node, from torchrun) where the config knows it,
    else ``per_node`` given by hand.
    """
    import dataclasses

    from plait.zero_sharding.zeropp import ZeroPPConfig

    auto = "ranks_per_node" in {f.name for f in dataclasses.fields(ZeroPPConfig)}
    partition: Any = "auto" if auto else per_node
    return {
        ZERO3_ONE_HOP: None,
        "plait ZeRO-3": None,
        "plait hpZ": dict(quantized_weights=False, quantized_gradients=False, hierarchical_partition_size=partition),
        "plait qwZ+qgZ": dict(hierarchical_partition_size=None),
        "plait ZeRO++": dict(hierarchical_partition_size=partition),
    }[mode]


def _plait(spec: dict[str, Any], mode: str) -> tuple[nn.Module, Any, str]:
    """plait ZeRO-3 (every parameter sharded, as FSDP2 does) with this mode's ZeRO++ parts.

    Uses ``ZeroConfig(zeropp=...)`` where the config has that field, else the policies passed
    to ``zero_shard`` by hand; returns which route was taken (for the results).
    """
    import dataclasses

    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding.zeropp import ZeroPPConfig, make_zeropp_policies

    settings = zeropp_settings(mode, spec["per_node"])
    base = dict(stage=3, param_persistence_threshold=0)
    if mode == ZERO3_ONE_HOP:
        model, optimizer = zero_shard(build_model(spec), torch.optim.AdamW, ZeroConfig(**base, two_hop_reduce=False),
                                      **OPTIMIZER)
        return model, optimizer, f"ZeroConfig(stage=3, two_hop_reduce=False); {_policies(model)}"
    if settings is None:
        model, optimizer = zero_shard(build_model(spec), torch.optim.AdamW, ZeroConfig(**base), **OPTIMIZER)
        return model, optimizer, f"ZeroConfig(stage=3); {_policies(model)}"
    zeropp = ZeroPPConfig(**settings)
    if "zeropp" in {f.name for f in dataclasses.fields(ZeroConfig)}:
        model, optimizer = zero_shard(build_model(spec), torch.optim.AdamW, ZeroConfig(**base, zeropp=zeropp),
                                      **OPTIMIZER)
        route = f"ZeroConfig(zeropp={zeropp})"
    else:
        gatherer, reducer = make_zeropp_policies(zeropp)
        model, optimizer = zero_shard(build_model(spec), torch.optim.AdamW, ZeroConfig(**base), gatherer=gatherer,
                                      reducer=reducer, **OPTIMIZER)
        route = f"make_zeropp_policies({zeropp}) as gatherer=/reducer="
    return model, optimizer, f"{route}; {_policies(model)}"


def _policies(model: nn.Module) -> str:
    """What the engine ended up with: gatherer and reducer, with hpZ's partition and qgZ's node size."""
    engine = getattr(model, "zero_engine", None)
    gatherer, reducer = getattr(engine, "gatherer", None), getattr(engine, "reducer", None)
    parts = [f"gatherer {type(gatherer).__name__}"]
    if hasattr(gatherer, "partition_size"):
        parts[-1] += f"(partition_size={gatherer.partition_size}, inner={type(gatherer.inner).__name__})"
    parts.append(f"reducer {type(reducer).__name__}")
    if hasattr(reducer, "bits"):
        parts[-1] += f"(bits={reducer.bits}, node_size={getattr(reducer, 'node_size', None)})"
    return ", ".join(parts)


def _one_hop(spec: dict[str, Any]) -> tuple[nn.Module, Any, str]:
    """ZeRO++ with qgZ's single flat all-to-all, built by hand (hpZ over the node, qwZ int8):
    what the two-hop qgZ saves on the link and costs in quantization work."""
    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding.zeropp import HierarchicalParamGatherer, QuantizedGradientReducer, QuantizedParamGatherer

    gatherer = HierarchicalParamGatherer(partition_size=spec["per_node"], inner=QuantizedParamGatherer())
    model, optimizer = zero_shard(build_model(spec), torch.optim.AdamW,
                                  ZeroConfig(stage=3, param_persistence_threshold=0), gatherer=gatherer,
                                  reducer=QuantizedGradientReducer(), **OPTIMIZER)
    return model, optimizer, f"policies by hand; {_policies(model)}"


def build(mode: str, spec: dict[str, Any]) -> tuple[nn.Module, Any, str]:
    """(model, optimizer, how it was built) of one mode."""
    if mode == ONE_HOP:
        return _one_hop(spec)
    if mode == "DDP":
        model = nn.parallel.DistributedDataParallel(build_model(spec))
        return model, torch.optim.AdamW(model.parameters(), **OPTIMIZER), "DistributedDataParallel"
    if mode in ("FSDP2", "FSDP2 HSDP"):
        hsdp = mode == "FSDP2 HSDP"
        model, optimizer = _fsdp2(spec, hsdp)
        return model, optimizer, "fully_shard on a (nodes, ranks per node) mesh" if hsdp else "fully_shard, 1-D mesh"
    return _plait(spec, mode)


class Counters:
    """This node's inter-node bytes, read by its local rank 0; collected on every rank at the end."""

    def __init__(self, device: str | None) -> None:
        self.device = device if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None

    def read(self) -> tuple[int, int]:
        """(bytes this node has sent over its link, TCP segments it retransmitted) so far; zeros on
        ranks that do not read."""
        return (interface_tx_bytes(self.device), tcp_retransmitted()) if self.device else (0, 0)

    def bracket(self, fn: Callable[[], Any]) -> tuple[Any, tuple[int, int], float]:
        """``fn()`` between barriers: (its result, this node's (bytes, retransmits) meanwhile, seconds).

        The barrier after the first reading matters: without it the ranks that do not read start
        ``fn`` while the reader is still reading, and their node-crossing traffic of collectives that
        do not pass through the reader (all-to-all, point-to-point) escapes the bracket.
        """
        dist.barrier()
        before = self.read()
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        dist.barrier()
        seconds = time.perf_counter() - start
        after = self.read()
        return out, (after[0] - before[0], after[1] - before[1]), seconds


def tcp_retransmitted() -> int:
    """TCP segments this network namespace has retransmitted (``/proc/net/snmp``'s ``RetransSegs``)."""
    with open("/proc/net/snmp") as handle:
        lines = [line.split() for line in handle.read().splitlines() if line.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


def _by_op_and_group(ledger: ByteLedger) -> dict[str, int]:
    """``"op group" -> logical bytes`` (which collective, over the world or a node's subgroup)."""
    out: dict[str, int] = {}
    for record in ledger.records:
        key = f"{record.op} {record.group}"
        out[key] = out.get(key, 0) + record.nbytes
    return out


def _error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}{where}"


def _say(text: str) -> None:
    if dist.get_rank() == 0:
        print(f"[two-node] {text}", flush=True)


def run(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Build every mode, alternate their steps, and return rank 0's figures (``None`` elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    node = rank // spec["per_node"]
    counters = Counters(spec["devices"][node])
    built: dict[str, tuple[nn.Module, Any]] = {}
    errors: dict[str, str] = {}
    routes: dict[str, str] = {}
    for mode in spec["modes"]:
        try:
            model, optimizer, routes[mode] = build(mode, spec)
            built[mode] = (model, optimizer)
        except Exception as exc:  # noqa: BLE001 - a mode that cannot run is a row saying why
            errors[mode] = _error(exc)
    losses: dict[str, list[float]] = {mode: [] for mode in built}
    sent: dict[str, list[int]] = {mode: [] for mode in built}
    retransmitted: dict[str, list[int]] = {mode: [] for mode in built}
    seconds: dict[str, list[float]] = {mode: [] for mode in built}
    ledgers: dict[str, ByteLedger] = {mode: ByteLedger() for mode in built}
    total = spec["warmup"] + spec["steps"]
    for step in range(total):
        batch = rank_slice(global_batch(step, spec["batch"], spec["seq"]), rank, world)
        for mode, (model, optimizer) in built.items():
            if mode in errors:
                continue

            def train(model=model, optimizer=optimizer, batch=batch) -> float:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                return float(loss)

            measured = step >= spec["warmup"]
            try:
                if measured:
                    with ledgers[mode]:
                        loss, (nbytes, resent), took = counters.bracket(train)
                    sent[mode].append(nbytes)
                    retransmitted[mode].append(resent)
                    seconds[mode].append(took)
                else:
                    loss = train()
            except Exception as exc:  # noqa: BLE001 - fails alike on every rank (same collectives)
                errors[mode] = _error(exc)
                continue
            losses[mode].append(loss)
        timing = {m: f"{statistics.median(s) * 1e3:.0f} ms" for m, s in seconds.items() if s}
        _say(f"step {step + 1}/{total} ({'measured' if step >= spec['warmup'] else 'warm-up'}) "
             + ", ".join(f"{m} {t}" for m, t in timing.items()))
    overhead = [counters.bracket(lambda: None)[1][0] for _ in range(5)]  # the barriers alone
    mine = {"node": node, "reader": counters.device is not None, "sent": sent, "overhead": overhead,
            "retransmitted": retransmitted,
            "losses": losses, "ledger": {m: _by_op_and_group(ledgers[m]) for m in built}}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    return _combine(everyone, spec, errors, routes, seconds)


def _combine(everyone: list[dict[str, Any]], spec: dict[str, Any], errors: dict[str, str],
             routes: dict[str, str], seconds: dict[str, list[float]]) -> dict[str, Any]:
    """Per mode: bytes crossing nodes per measured step (both directions, the barrier's share taken
    off), step times, first/final loss (mean over ranks: the global batch's loss), logical bytes."""
    readers = [r for r in everyone if r["reader"]]
    overhead = statistics.median(sum(r["overhead"][i] for r in readers) for i in range(len(readers[0]["overhead"])))
    out: dict[str, Any] = {"barrier_bytes": overhead, "modes": {}}
    for mode in spec["modes"]:
        if mode in errors or mode not in seconds:
            out["modes"][mode] = {"error": errors.get(mode, "not built")}
            continue
        per_step = [sum(r["sent"][mode][i] for r in readers) for i in range(len(seconds[mode]))]
        per_rank_losses = [r["losses"][mode] for r in everyone]
        mean_loss = [statistics.fmean(ls[i] for ls in per_rank_losses) for i in range(len(per_rank_losses[0]))]
        out["modes"][mode] = {
            "route": routes.get(mode, ""),
            "crossing_bytes": [max(0, b - overhead) for b in per_step],
            "by_node": {str(r["node"]): r["sent"][mode] for r in readers},
            "tcp_retransmitted": [sum(r["retransmitted"][mode][i] for r in readers) for i in range(len(per_step))],
            "seconds": seconds[mode],
            "first_loss": mean_loss[0], "final_loss": mean_loss[-1],
            "ledger_rank0": everyone[0]["ledger"][mode],
        }
    return out


def main(path: str) -> None:
    """Read the spec, join the group torchrun set up, run, and write rank 0's figures."""
    with open(path) as handle:
        spec = json.load(handle)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout"]))
    try:
        result = run(spec)
        if result is not None:
            with open(spec["out"], "w") as handle:
                json.dump(result, handle)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
