"""The moe-layers benchmark suite (``plait bench moe-layers [--quick]``).

fp32, one torch thread per process, dropless routing throughout.

1. **Mixtral-shaped training step at W=2 (the issue's target row):** HF transformers'
   ``MixtralForCausalLM`` at :data:`MIXTRAL` (Mixtral-8x7B's ratios at tiny size: every layer MoE,
   8 experts, top-2, intermediate 3.5 x hidden, 4 query heads per KV head, vocab 8 x hidden;
   hidden 256, 4 layers), converted by :func:`~plait.moe_layers.hf.convert_hf_moe` and run with
   EP=2 (grouped GEMMs, experts split over the two ranks, tokens exchanged by all-to-all), against
   the same HF model unconverted with its own eager per-expert loop under plain data parallelism
   (every rank holds every expert; all gradients all-reduced). Same weights, same batches
   (2 x 128 tokens per rank), one training step each: forward, backward, gradient all-reduce
   (:func:`~plait.moe_layers.average_gradients`) and AdamW. Target: plait >= 1.5x faster (time
   ratio <= 0.667). Beside it, the same HF model with its default experts implementation on this
   torch (``grouped_mm``), no target. Each model's note gives the MoE blocks' share of the step's
   FLOPs (:func:`moe_flop_share`).
   The same step on the project's tiny-llama-MoE (``plait.kernels.testing.tiny_llama_moe``: vocab
   4096, hidden 256, 8 layers of which only the 4 odd ones are MoE, SwiGLU 688) is reported without
   a target: there the MoE layers are under half the FLOPs (dense MLPs in half the layers, a
   4096-row head), so a 1.5x faster step needs MoE layers about 3.9x faster. "The loop" there
   is its ``MoEMLP``, the HF-style per-expert loop of ``nn.Linear`` experts; plait's model is the
   same model after :func:`~plait.moe_layers.tiny_llama.convert_tiny_llama_moe` (same weights).
   Then each model's forward + backward in one process (plait's conversion without expert
   parallelism against the loop): only the MoE layers' form differs, no all-reduce, no optimizer.
2. **One MoE layer, fwd+bwd, one process, at three token counts:** 2 x 16 (a few rows per
   expert: per-call overhead dominates), 2 x 128 (the model's batch) and 2 x 1024 (hundreds of
   rows per expert: the GEMMs dominate). Beside each, the GEMM floor: the six expert GEMMs of
   fwd+bwd alone (same shapes, same routing counts, nothing else), once with torch's ``mm`` (the
   loop's GEMM: MKL) and once with the grouped op's GEMM (:func:`plait.kernels.ops.moe_grouped.linear_nt`:
   oneDNN for fp32 on CPU). The grouping runs the same FLOPs as the loop; what it can save is the
   loop's per-expert work (a ``nonzero``, a gather, three ``nn.Linear`` calls and their autograd
   nodes, a scatter-add per expert), so with the same GEMM the MKL floor bounds it. The rest of the
   gain is the GEMM library: on a CPU whose MKL runs its AVX2 code (non-Intel), oneDNN's AVX-512
   GEMM is about 2x faster. The 2 x 128 row is also timed on the thread's CPU clock (3x the
   rounds), which other jobs on a shared machine disturb far less than the wall clock.
3. **The grouped op's torch methods** at 2 x 128: the default CPU method (``segments``) against
   torch's own ``F.grouped_mm`` and one zero-padded ``[E, max_rows, H]`` ``torch.bmm`` pair.
4. **W=2, EP=2 layer on gloo** against DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE``
   (ep_size=2, k=2, ``drop_tokens=False`` = dropless), alternating in the same run; target <= 1.0x.
5. **All-to-all logical bytes** per step and rank against the formula ``8E + 2(S+R)Hb`` (exact),
   with DeepSpeed's all-to-all bytes (counted from outside) beside it: DeepSpeed pads every expert
   to the largest expert load of the step.

Gloo wall time is not NCCL's; rows 1 and 4 compare implementations on the same transport only.
"""

from __future__ import annotations

import copy
import dataclasses
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.bench import BenchRow, TimingStats, interleaved_timing, one_thread, timing_row
from plait.kernels.testing import run_distributed

GROUPED_TARGET = 1 / 1.5
DEEPSPEED_TARGET = 1.0
LOOP = "per-expert loop (tiny-llama-MoE MoEMLP)"
HF_LOOP = "HF MixtralForCausalLM, its eager per-expert loop, W=2 data parallel (every rank all experts)"

MIXTRAL = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 896, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "num_local_experts": 8,
           "num_experts_per_tok": 2, "max_position_embeddings": 1024}
"""The Mixtral-shaped tiny model: Mixtral-8x7B's ratios (every layer MoE, 8 experts, top-2,
intermediate 3.5 x hidden = 14336/4096, 4 query heads per KV head = 32/8, vocab 8 x hidden ~ 32000/4096)
at hidden 256 with 64-wide heads and 4 layers."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark's layer and batch (the tiny-llama-MoE MoE layer's dimensions)."""

    hidden: int = 256
    intermediate: int = 688
    experts: int = 8
    top_k: int = 2
    batch: int = 2
    seq: int = 128


LAYER_SEQS = (16, 128, 1024)
"""Tokens per sequence of the layer rows (2 sequences each)."""


def run(quick: bool) -> list[BenchRow]:
    """Run the suite.

    Args:
        quick: 64-token sequences (layer rows at 16 and 64), 1 warm-up and 5 timed rounds
            (instead of 128, 3 and 10).

    Returns:
        The table's rows.

    Raises:
        RuntimeError: transformers is missing (the target row's model is HF's ``MixtralForCausalLM``).
    """
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("plait bench moe-layers runs HF's MixtralForCausalLM for its target row; install "
                           "transformers with pip install 'plait-moe-layers[hf]'.") from exc
    shape = Shape(seq=64 if quick else 128)
    warmup, steps = (1, 5) if quick else (3, 10)
    rows = run_distributed(_mixtral_step_rows, 2, shape, warmup, steps, timeout=600)[0]
    rows += run_distributed(_model_step_rows, 2, shape, warmup, steps, timeout=600)[0]
    rows += _model_fwd_bwd_rows(shape, warmup, steps)
    for seq in (16, shape.seq) if quick else LAYER_SEQS:
        rows += _grouped_vs_loop(dataclasses.replace(shape, seq=seq), warmup, steps,
                                 cpu_clock=seq == shape.seq)
    rows += _method_rows(shape, warmup, steps)
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


def _step(module: torch.nn.Module, x: torch.Tensor, set_to_none: bool = True):
    def step() -> None:
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        module.zero_grad(set_to_none=set_to_none)
    return step


def _page_faults(step: Callable[[], None], steps: int) -> float:
    """Minor page faults of this thread per call of ``step`` (after one warm-up call)."""
    step()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / steps


def _models(shape: Shape) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(loop, plait)``: tiny-llama-MoE and its converted copy (same weights)."""
    from plait.kernels.testing import tiny_llama_moe
    from plait.moe_layers.tiny_llama import convert_tiny_llama_moe

    torch.manual_seed(0)
    loop = tiny_llama_moe(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                          num_experts=shape.experts, top_k=shape.top_k)
    plait = copy.deepcopy(loop)
    convert_tiny_llama_moe(plait)
    return loop, plait


def _tokens(shape: Shape, seed: int) -> torch.Tensor:
    return torch.randint(0, 4096, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(seed))


def _train_step(model: torch.nn.Module, ids: torch.Tensor, groups: Any) -> Callable[[], None]:
    """One training step: forward, backward, gradient all-reduce, AdamW."""
    from plait.moe_layers import average_gradients

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        for param in model.parameters():  # the loop skips experts without tokens: zeros, as DDP would reduce
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        average_gradients(model, groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _mixtral_models() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """``(loop, plait, hf_grouped)``: HF's ``MixtralForCausalLM`` at :data:`MIXTRAL` with its eager
    per-expert loop, the same model converted by :func:`~plait.moe_layers.hf.convert_hf_moe`, and the
    same model with HF's default experts implementation (``grouped_mm``). Same weights."""
    import transformers

    from plait.moe_layers.hf import convert_hf_moe

    torch.manual_seed(0)
    loop = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
    loop.set_experts_implementation("eager")
    hf_grouped = copy.deepcopy(loop)
    hf_grouped.set_experts_implementation("grouped_mm")
    plait = copy.deepcopy(loop)
    convert_hf_moe(plait)
    return loop, plait, hf_grouped


def moe_flop_share(model: torch.nn.Module, ids: torch.Tensor, moe_types: tuple[str, ...]) -> float:
    """Share of one training forward + backward's FLOPs (``torch.utils.flop_counter``: GEMMs and
    attention) spent inside the modules whose class name is in ``moe_types`` (router included)."""
    from torch.utils.flop_counter import FlopCounterMode

    prefix = type(model).__name__
    names = {f"{prefix}.{name}" for name, module in model.named_modules() if type(module).__name__ in moe_types}
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    counts = counter.get_flop_counts()
    return sum(sum(counts[name].values()) for name in names if name in counts) / sum(counts["Global"].values())


def _mixtral_step_rows(shape: Shape, warmup: int, steps: int) -> list[BenchRow]:
    """The issue's target row (runs on each of the 2 ranks): a training step of the Mixtral-shaped
    HF model, plait's conversion with EP=2 against HF's own expert loop under data parallelism."""
    from plait.moe_layers import apply_expert_parallel, make_expert_parallel_groups

    groups = make_expert_parallel_groups(dist.get_world_size())
    loop, plait, hf_grouped = _mixtral_models()
    ids = torch.randint(0, MIXTRAL["vocab_size"], (shape.batch, shape.seq),
                        generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    with torch.no_grad():
        torch.testing.assert_close(plait(ids).logits, loop(ids).logits, atol=1e-4, rtol=1e-4)  # same model
    with one_thread():
        share = moe_flop_share(loop, ids, ("MixtralSparseMoeBlock",))
    apply_expert_parallel(plait, groups)
    with one_thread():
        stats = interleaved_timing({"plait": _train_step(plait, ids, groups), "loop": _train_step(loop, ids, groups),
                                    "hf_grouped": _train_step(hf_grouped, ids, groups)},
                                   warmup=warmup, steps=steps)
    merged = _slowest_rank(stats, steps)
    bench = (f"Mixtral-shaped training step (HF MixtralForCausalLM, {MIXTRAL['num_hidden_layers']} layers all MoE, "
             f"H={MIXTRAL['hidden_size']} I={MIXTRAL['intermediate_size']}, fwd+bwd+all-reduce+AdamW), W=2 gloo, "
             f"{shape.batch}x{shape.seq} tokens/rank: plait EP=2")
    target = timing_row(bench, merged["plait"], HF_LOOP, merged["loop"], target_ratio=GROUPED_TARGET)
    target = dataclasses.replace(target, note=f"MoE blocks = {share:.0%} of the step's FLOPs; {target.note}")
    grouped = timing_row(bench, merged["plait"], "the same HF model, its default experts_implementation "
                         "(grouped_mm: torch F.grouped_mm), W=2 data parallel", merged["hf_grouped"])
    return [target, grouped]


def _model_step_rows(shape: Shape, warmup: int, steps: int) -> list[BenchRow]:
    """Row 1 of the module docstring (runs on each of the 2 ranks)."""
    from plait.moe_layers import apply_expert_parallel, make_expert_parallel_groups

    world = dist.get_world_size()
    groups = make_expert_parallel_groups(world)
    loop, plait = _models(shape)
    ids = _tokens(shape, 10 + dist.get_rank())
    with one_thread():
        share = moe_flop_share(loop, ids, ("MoEMLP",))
    apply_expert_parallel(plait, groups)
    with one_thread():
        stats = interleaved_timing({"plait": _train_step(plait, ids, groups), "loop": _train_step(loop, ids, groups)},
                                   warmup=warmup, steps=steps)
    merged = _slowest_rank(stats, steps)
    bench = (f"tiny-llama-MoE training step (fwd+bwd+all-reduce+AdamW), W=2 gloo, "
             f"{shape.batch}x{shape.seq} tokens/rank")
    row = timing_row(bench, merged["plait"], f"{LOOP}, W=2 (every rank all experts)", merged["loop"])
    return [dataclasses.replace(row, note=f"MoE layers = {share:.0%} of the step's FLOPs; {row.note}")]


def _slowest_rank(stats: dict[str, TimingStats], steps: int) -> dict[str, TimingStats]:
    """The step ends when the slower rank ends: per round, the max over ranks."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: s.samples for name, s in stats.items()})
    return {name: TimingStats.of([max(rank[name][i] for rank in gathered) for i in range(steps)]) for name in stats}


def _model_fwd_bwd_rows(shape: Shape, warmup: int, steps: int) -> list[BenchRow]:
    """The same model's forward + backward in one process: only the MoE layers' form differs
    (no expert parallelism, no all-reduce, no optimizer), for the Mixtral-shaped HF model and for
    tiny-llama-MoE."""
    hf_loop, hf_plait, _ = _mixtral_models()
    hf_ids = torch.randint(0, MIXTRAL["vocab_size"], (shape.batch, shape.seq),
                           generator=torch.Generator().manual_seed(10))
    loop, plait = _models(shape)
    return (_fwd_bwd_row("Mixtral-shaped HF MixtralForCausalLM", hf_plait, hf_loop, hf_ids,
                         "HF MixtralForCausalLM, its eager per-expert loop", shape, warmup, steps)
            + _fwd_bwd_row("tiny-llama-MoE", plait, loop, _tokens(shape, 10), LOOP, shape, warmup, steps))


def _fwd_bwd_row(name: str, plait: torch.nn.Module, loop: torch.nn.Module, ids: torch.Tensor, peer: str,
                 shape: Shape, warmup: int, steps: int) -> list[BenchRow]:
    def fwd_bwd(model: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return step
    with torch.no_grad():
        torch.testing.assert_close(plait(ids).logits, loop(ids).logits, atol=1e-4, rtol=1e-4)  # same model
    with one_thread():
        stats = interleaved_timing({"plait": fwd_bwd(plait), "loop": fwd_bwd(loop)}, warmup=warmup, steps=steps)
    bench = f"{name} fwd+bwd, one process, {shape.batch}x{shape.seq} tokens"
    return [timing_row(bench, stats["plait"], peer, stats["loop"])]


def _gemm_floor(layer, x: torch.Tensor, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The layer's six GEMMs per expert (forward: gate/up, down; backward: d_act, d_down, d_x,
    d_gate_up) on this step's routing counts, with nothing around them; ``linear(a, b) = a @ b.T``."""
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
            linear(x_rows[rows_e], w_gate_up[expert])
            linear(act[rows_e], w_down[expert])
            linear(grad[rows_e], w_down[expert].t())
            linear(grad[rows_e].t(), act[rows_e].t())
            linear(gate_up[rows_e], w_gate_up[expert].t())
            linear(gate_up[rows_e].t(), x_rows[rows_e].t())
    return step


def _grouped_vs_loop(shape: Shape, warmup: int, steps: int, *, cpu_clock: bool) -> list[BenchRow]:
    """Row 2 of the module docstring at one token count."""
    from plait.kernels.ops.moe_grouped import linear_nt

    layer = _plait_layer(shape)
    loop = _loop_layer(layer)
    # The tokens need gradients, as inside a model (earlier layers train too).
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), loop(x), atol=1e-4, rtol=1e-3)  # same computation
    candidates = {"grouped": _step(layer, x), "loop": _step(loop, x),
                  "floor (mm)": _gemm_floor(layer, x, lambda a, b: torch.mm(a, b.t())),
                  "floor (op)": _gemm_floor(layer, x, linear_nt)}
    with one_thread():
        timings = [("time (ms)", interleaved_timing(candidates, warmup=warmup, steps=steps))]
        if cpu_clock:
            timings.append(("CPU time (ms)", interleaved_timing(candidates, warmup=warmup, steps=3 * steps,
                                                                clock=time.thread_time)))
    name = f"{shape.batch}x{shape.seq} tokens, E={shape.experts} top-{shape.top_k}"
    rows = _allocation_rows(layer, loop, x, name, warmup, steps) if cpu_clock else []
    for figure, timing in timings:
        target = GROUPED_TARGET if figure == "time (ms)" and shape.seq == Shape.seq else None
        rows.append(timing_row(f"MoE layer fwd+bwd, {name}", timing["grouped"], LOOP, timing["loop"],
                               target_ratio=target, figure=figure))
        for floor, what in (("floor (mm)", "torch mm = MKL, the loop's GEMM"),
                            ("floor (op)", "linear_nt = oneDNN, the grouped op's GEMM")):
            row = timing_row(f"GEMM floor ({what}): the 6 expert GEMMs of fwd+bwd alone, {name}",
                             timing[floor], LOOP, timing["loop"], figure=figure)
            rows.append(dataclasses.replace(row, note=f"no MoE layer beats its own floor; {row.note}"))
    return rows


def _allocation_rows(layer, loop, x: torch.Tensor, name: str, warmup: int, steps: int) -> list[BenchRow]:
    """The cost of the stacked weight gradient: a fresh ``[E, 2I, H]`` + ``[E, H, I]`` per step that
    glibc's allocator returns to the OS when ``zero_grad`` frees it, so the next step page-faults it
    in again (the loop's 24 small gradients are recycled). Kept gradients (``set_to_none=False``,
    as under gradient accumulation) add into the same memory instead."""
    candidates = {"grouped": _step(layer, x, set_to_none=False), "loop": _step(loop, x, set_to_none=False)}
    with one_thread():
        faults = {key: _page_faults(_step(module, x), steps) for key, module in (("grouped", layer), ("loop", loop))}
        kept = interleaved_timing(candidates, warmup=warmup, steps=steps)
    layer.zero_grad(set_to_none=True)
    loop.zero_grad(set_to_none=True)
    fault_row = BenchRow(benchmark=f"minor page faults per MoE layer fwd+bwd step, {name}", figure="faults/step",
                         ours=faults["grouped"], peer=LOOP, peer_value=faults["loop"],
                         note="zero_grad(set_to_none=True) frees the stacked expert gradients each step")
    kept_row = timing_row(f"MoE layer fwd+bwd, gradients kept between steps (zero_grad(set_to_none=False)), {name}",
                          kept["grouped"], LOOP, kept["loop"])
    return [fault_row, kept_row]


def _method_rows(shape: Shape, warmup: int, steps: int) -> list[BenchRow]:
    """Row 3 of the module docstring: the grouped op's torch methods, fwd+bwd."""
    from plait.kernels.ops.moe_grouped import grouped_gated_mlp_torch

    layer = _plait_layer(shape)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, losses = layer(x, return_losses=True)
    counts = losses.expert_load
    rows = torch.randn(int(counts.sum()), shape.hidden, generator=torch.Generator().manual_seed(2),
                       requires_grad=True)
    w_gate_up, w_down = layer.experts.gate_up_proj, layer.experts.down_proj

    def method(name: str) -> Callable[[], None]:
        def step() -> None:
            grouped_gated_mlp_torch(rows, counts, w_gate_up, w_down, method=name).square().mean().backward()
            rows.grad, w_gate_up.grad, w_down.grad = None, None, None
        return step
    methods = ("segments", "grouped_mm", "padded_bmm")
    with one_thread():
        stats = interleaved_timing({name: method(name) for name in methods}, warmup=warmup, steps=steps)
    name = f"{int(counts.sum())} rows, E={shape.experts}"
    return [timing_row(f"grouped GEMM op fwd+bwd, method={other} (torch), {name}", stats[other],
                       "method=segments (the CPU default)", stats["segments"]) for other in methods[1:]]


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
    merged = _slowest_rank(stats, steps)
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
