"""``plait bench compile``: step time of an HF Llama at W=2 (CPU, gloo, inductor's CPU backend),
eager and compiled per block (torchtitan's way: ``block.compile()`` on every decoder layer), for
plait ZeRO-1/2/3 and FSDP2 (``fully_shard`` per block and on the root), in one run.

Every rank builds the eight contenders (four setups, eager and compiled) from the same seed and
runs their first step untimed, one contender at a time, counting what dynamo did during it (graph
breaks, graphs compiled). The timed steps then alternate the contenders in A B ... B A order (the
order reverses every step), each step between two barriers, rank 0's clock; graphs compiled during
the timed steps are the recompiles. Rows: compiled vs eager per setup (target <= 0.9), plait ZeRO-3
compiled vs FSDP2 compiled (target <= 0.85), and per compiled setup the graph breaks and recompiles.

Quick mode: a 2-layer, 128-wide Llama (vocab 1024), 1 warm-up and 6 timed steps; the full run: an
8-layer, 512-wide Llama with a vocabulary of 8192 (33.7M parameters), 3 warm-up and 10 timed steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.bench import BenchRow, TimingStats, timing_row
from plait.kernels.testing import run_distributed

SETUPS = ("plait ZeRO-1", "plait ZeRO-2", "plait ZeRO-3", "FSDP2")
QUICK = dict(model=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=1024), batch=4, seq=64, warmup=1, steps=6)
FULL = dict(model=dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=8, vocab_size=8192), batch=4, seq=128, warmup=3, steps=10)
COMPILED_VS_EAGER, ZERO3_VS_FSDP2 = 0.9, 0.85  # the targets on the ratios


def _model(spec: dict[str, Any]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**spec["model"], max_position_embeddings=spec["seq"])
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _build(setup: str, compiled: bool, spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(spec)
    if setup == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        from plait.zero_sharding import ZeroConfig, zero_shard

        model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=int(setup[-1])), lr=1e-3)
    if compiled:
        for block in model.model.layers:
            block.compile()
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return time.perf_counter() - start


def _dynamo_counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Every rank: build, warm up (counting dynamo's work), then the alternating timed steps."""
    torch.set_num_threads(1)
    # Eight models share the decoder layer's code: let dynamo keep a graph per layer and model.
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 1024
    names = [f"{setup} {'compiled' if compiled else 'eager'}" for setup in SETUPS for compiled in (False, True)]
    contenders = {name: _build(name.rsplit(" ", 1)[0], name.endswith("compiled"), spec) for name in names}
    ids = torch.randint(0, spec["model"]["vocab_size"], (spec["batch"] // dist.get_world_size(), spec["seq"]),
                        generator=torch.Generator().manual_seed(dist.get_rank()))
    counts: dict[str, dict[str, int]] = {}
    for name, (model, optimizer) in contenders.items():
        breaks, graphs = _dynamo_counts()
        for _ in range(spec["warmup"]):
            _step(model, optimizer, ids)
        after_breaks, after_graphs = _dynamo_counts()
        counts[name] = {"breaks": after_breaks - breaks, "graphs": after_graphs - graphs, "recompiles": 0}
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(spec["steps"]):
        for name in (names if step % 2 == 0 else names[::-1]):
            graphs = _dynamo_counts()[1]
            times[name].append(_step(*contenders[name], ids))
            counts[name]["recompiles"] += _dynamo_counts()[1] - graphs
    return {"times": times, "counts": counts,
            "params": sum(p.numel() for p in _model(spec).parameters())}


def _rows(result: dict[str, Any], spec: dict[str, Any]) -> list[BenchRow]:
    stats = {name: TimingStats.of(samples) for name, samples in result["times"].items()}
    size = f"HF Llama {result['params'] / 1e6:.1f}M, W=2"
    rows = []
    for setup in SETUPS:
        rows.append(timing_row(f"{setup} step, compiled per block vs eager ({size})", stats[f"{setup} compiled"],
                               f"{setup} eager", stats[f"{setup} eager"], target_ratio=COMPILED_VS_EAGER))
    rows.append(timing_row(f"compiled per block step, plait ZeRO-3 vs FSDP2 ({size})", stats["plait ZeRO-3 compiled"],
                           "FSDP2 compiled", stats["FSDP2 compiled"], target_ratio=ZERO3_VS_FSDP2))
    for setup in SETUPS:
        count = result["counts"][f"{setup} compiled"]
        rows.append(BenchRow(benchmark=f"{setup} compiled per block ({size})", figure="graph breaks (first step)",
                             ours=count["breaks"], note=f"{count['graphs']} graphs compiled in the first step"))
        rows.append(BenchRow(benchmark=f"{setup} compiled per block ({size})", figure="recompiles (timed steps)",
                             ours=count["recompiles"], target="= 0", passed=count["recompiles"] == 0,
                             note=f"over {spec['steps']} steps"))
    return rows


def run(quick: bool) -> list[BenchRow]:
    """Run the benchmark (see the module docstring).

    Args:
        quick: the 2-layer model and 6 timed steps.

    Returns:
        The table's rows.
    """
    spec = QUICK if quick else FULL
    result = run_distributed(_worker, 2, spec, timeout=3000)[0]
    return _rows(result, spec)
