"""The moe-layers benchmark suite (``plait bench moe-layers [--quick]``).

One Mixtral-shaped MoE layer of the shared tiny-llama-MoE (hidden 256, SwiGLU 688, 8 experts,
top-2, fp32, one torch thread per process), forward + backward on 2 x 128 tokens per rank
(quick: 2 x 64), dropless routing:

1. one process: plait's layer (one permutation, grouped GEMMs) against the per-expert loop of
   tiny-llama-MoE's ``MoEMLP`` (the HF-style reference form) with the same weights; target:
   grouped >= 1.5x faster (time ratio <= 0.667). Beside it, timed in the same rounds, the floor
   any MoE layer of this shape has on this CPU: the six GEMMs per expert of its forward and
   backward alone (same shapes, same routing counts, nothing else), against the same loop;
   that ratio is the best any grouping of the GEMMs could reach here. The three are timed again
   on the thread's CPU clock (3x the rounds), which the other jobs of a shared machine disturb far
   less than the wall clock;
2. W=2, EP=2 on gloo: plait's expert-parallel layer against DeepSpeed 0.19.8's
   ``deepspeed.moe.layer.MoE`` (ep_size=2, k=2, ``drop_tokens=False`` = dropless), alternating
   in the same run; target: <= 1.0x;
3. all-to-all logical bytes per step and rank against the formula ``8E + 2(S+R)Hb`` (exact), with
   DeepSpeed's all-to-all bytes (counted from outside) beside it: DeepSpeed pads every expert to
   the largest expert load of the step.

Gloo wall time is not NCCL's; row 2 compares two implementations on the same transport only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.bench import BenchRow, TimingStats, interleaved_timing, one_thread, timing_row
from plait.kernels.testing import run_distributed

GROUPED_TARGET = 1 / 1.5
DEEPSPEED_TARGET = 1.0


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark's layer and batch."""

    hidden: int = 256
    intermediate: int = 688
    experts: int = 8
    top_k: int = 2
    batch: int = 2
    seq: int = 128


def run(quick: bool) -> list[BenchRow]:
    """Run the suite.

    Args:
        quick: 64-token sequences, 1 warm-up and 5 timed rounds (instead of 128, 3 and 10).

    Returns:
        The table's rows.
    """
    shape = Shape(seq=64 if quick else 128)
    warmup, steps = (1, 5) if quick else (3, 10)
    rows = _grouped_vs_loop(shape, warmup, steps)
    rows += run_distributed(_expert_parallel_rows, 2, shape, warmup, steps, timeout=600)[0]
    return rows


def _plait_layer(shape: Shape):
    from plait.moe_layers import MoE, MoEConfig

    torch.manual_seed(0)
    return MoE(MoEConfig(hidden_size=shape.hidden, num_experts=shape.experts, intermediate_size=shape.intermediate,
                         top_k=shape.top_k))


def _loop_layer(layer) -> torch.nn.Module:
    """tiny-llama-MoE's per-expert loop with ``layer``'s weights."""
    from plait.kernels.testing.tiny_llama import MoEMLP, TinyLlamaConfig

    cfg = layer.config
    loop = MoEMLP(TinyLlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                  num_experts=cfg.num_experts, top_k=cfg.top_k))
    inter = cfg.intermediate_size
    with torch.no_grad():
        loop.router.weight.copy_(layer.router.weight)
        for index, expert in enumerate(loop.experts):
            expert.gate_proj.weight.copy_(layer.experts.gate_up_proj[index, :inter])
            expert.up_proj.weight.copy_(layer.experts.gate_up_proj[index, inter:])
            expert.down_proj.weight.copy_(layer.experts.down_proj[index])
    return loop


def _step(module: torch.nn.Module, x: torch.Tensor):
    def step() -> None:
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        module.zero_grad(set_to_none=True)
    return step


def _gemm_floor(layer, x: torch.Tensor):
    """The layer's six GEMMs per expert (forward: gate/up, down; backward: d_act, d_down, d_x,
    d_gate_up) on this step's routing counts, with nothing around them."""
    with torch.no_grad():
        _, losses = layer(x, return_losses=True)
    counts = losses.expert_load.tolist()
    w_gate_up, w_down = layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach()
    rows, hidden, inter = sum(counts), w_down.shape[1], w_down.shape[2]
    gen = torch.Generator().manual_seed(3)
    x_rows, gate_up, act, grad = (torch.randn(rows, n, generator=gen) for n in (hidden, 2 * inter, inter, hidden))

    def step() -> None:
        start = 0
        for expert, count in enumerate(counts):
            rows_e = slice(start, start + count)
            start += count
            torch.mm(x_rows[rows_e], w_gate_up[expert].t())
            torch.mm(act[rows_e], w_down[expert].t())
            torch.mm(grad[rows_e], w_down[expert])
            torch.mm(grad[rows_e].t(), act[rows_e])
            torch.mm(gate_up[rows_e], w_gate_up[expert])
            torch.mm(gate_up[rows_e].t(), x_rows[rows_e])
    return step


def _grouped_vs_loop(shape: Shape, warmup: int, steps: int) -> list[BenchRow]:
    layer = _plait_layer(shape)
    loop = _loop_layer(layer)
    # The tokens need gradients, as inside a model (earlier layers train too).
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), loop(x), atol=1e-4, rtol=1e-3)  # same computation
    candidates = {"grouped": _step(layer, x), "loop": _step(loop, x), "floor": _gemm_floor(layer, x)}
    with one_thread():
        stats = interleaved_timing(candidates, warmup=warmup, steps=steps)
        cpu = interleaved_timing(candidates, warmup=warmup, steps=3 * steps, clock=time.thread_time)
    name = f"{shape.batch}x{shape.seq} tokens, E={shape.experts} top-{shape.top_k}"
    loop_name = "per-expert loop (tiny-llama-MoE MoEMLP)"
    rows = []
    for figure, timing in (("time (ms)", stats), ("CPU time (ms)", cpu)):
        target = GROUPED_TARGET if figure == "time (ms)" else None  # the target is on the step time
        rows.append(timing_row(f"MoE layer fwd+bwd, {name}", timing["grouped"], loop_name, timing["loop"],
                               target_ratio=target, figure=figure))
        floor = timing_row(f"GEMM floor: the 6 expert GEMMs of fwd+bwd alone, {name}", timing["floor"], loop_name,
                           timing["loop"], figure=figure)
        rows.append(dataclasses.replace(floor, note=f"best ratio any grouping reaches on this CPU; {floor.note}"))
    return rows


def _deepspeed_layer(layer, ep_size: int) -> tuple[Any, str]:
    """DeepSpeed's MoE with ``layer``'s router and this rank's experts, or ``(None, reason)``."""
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except Exception as exc:  # noqa: BLE001 - any import failure makes the peer unavailable
        return None, f"deepspeed unavailable: {exc!r}"
    from plait.moe_layers.layer import DenseGatedMLP

    cfg = layer.config
    deepspeed.init_distributed(dist_backend="gloo")
    expert = DenseGatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
    peer = DeepSpeedMoE(cfg.hidden_size, expert, num_experts=cfg.num_experts, ep_size=ep_size, k=cfg.top_k,
                        capacity_factor=1.0, drop_tokens=False, min_capacity=0)
    peer.set_deepspeed_parallelism()
    with torch.no_grad():
        peer.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
        local = peer.deepspeed_moe.experts.deepspeed_experts
        for index, module in enumerate(local):
            module.gate_up_proj.weight.copy_(layer.experts.gate_up_proj[index])
            module.down_proj.weight.copy_(layer.experts.down_proj[index])
    return peer, ""


def _expert_parallel_rows(shape: Shape, warmup: int, steps: int) -> list[BenchRow]:
    from plait.kernels.collectives import ByteLedger, count_torch_distributed
    from plait.moe_layers import apply_expert_parallel, make_expert_parallel_groups

    world = dist.get_world_size()
    layer = _plait_layer(shape)
    apply_expert_parallel(layer, make_expert_parallel_groups(world))
    peer, reason = _deepspeed_layer(layer, world)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=torch.Generator().manual_seed(2 + dist.get_rank()),
                    requires_grad=True)
    candidates = {"plait": _step(layer, x)}
    if peer is not None:
        candidates["deepspeed"] = _step(peer, x)
    stats = interleaved_timing(candidates, warmup=warmup, steps=steps)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {name: s.samples for name, s in stats.items()})
    # The step ends when the slower rank ends: per round, the max over ranks.
    merged = {name: TimingStats.of([max(rank[name][i] for rank in gathered) for i in range(steps)])
              for name in stats}
    bench = f"EP=2 MoE layer fwd+bwd, W=2 gloo, {shape.batch}x{shape.seq} tokens/rank"
    time_row = timing_row(bench, merged["plait"], "DeepSpeed MoE (ep_size=2, dropless)", merged.get("deepspeed"),
                          target_ratio=DEEPSPEED_TARGET)
    if peer is None:
        time_row = dataclasses.replace(time_row, note=reason)
    return [time_row, _bytes_row(layer, peer, x, shape, ByteLedger, count_torch_distributed)]


def _bytes_row(layer, peer, x, shape: Shape, ledger_cls, count_peer) -> BenchRow:
    with ledger_cls() as ledger:  # one step, as timed, keeping the forward's expert loads
        out, losses = layer(x, return_losses=True)
        out.square().mean().backward()
        layer.zero_grad(set_to_none=True)
    world, rank = dist.get_world_size(), dist.get_rank()
    loads: list[torch.Tensor] = [torch.empty_like(losses.expert_load) for _ in range(world)]
    dist.all_gather(loads, losses.expert_load)
    per_rank = shape.experts // world
    sent = int(losses.expert_load.sum())
    received = sum(int(load[rank * per_rank:(rank + 1) * per_rank].sum()) for load in loads)
    formula = 8 * shape.experts + 2 * (sent + received) * shape.hidden * x.element_size()
    measured = ledger.total(op="all_to_all")
    peer_bytes, note = None, "formula 8E + 2(S+R)Hb; rank 0"
    if peer is not None:
        with ledger_cls() as peer_ledger, count_peer():
            _step(peer, x)()
        peer_bytes = float(peer_ledger.total(op="all_to_all"))
        note += "; DeepSpeed pads each expert to the step's largest load"
    ratio = measured / formula
    return BenchRow(benchmark=f"EP=2 all-to-all bytes/step/rank, E={shape.experts} top-{shape.top_k}",
                    figure="bytes", ours=float(measured), peer="DeepSpeed MoE" if peer is not None else "",
                    peer_value=peer_bytes, ratio=ratio, target="= formula", passed=measured == formula,
                    note=f"{note}; formula = {formula}")
