"""GRIN against straight-through routing on a small model (``plait bench moe-layers-quality [--quick]``).

tiny-llama-MoE (4 layers, hidden 128, 2 MoE layers of 8 experts, top-2, SwiGLU 344, vocab 4096,
3.7M parameters) converted to plait MoE layers, trained twice from the same initial weights on
the same batches (the shared corpus, 8 x 64 tokens per step, AdamW lr 1e-3, loss + 0.01 x the
load-balancing loss, one torch thread): once with the straight-through top-2 router, once with
GRIN's SparseMixer-v2 (:mod:`plait.moe_layers.grin`). 300 steps (quick: 40).

Rows: the final training loss (mean of the last 20 steps) and the expert-load imbalance (max over
mean of the per-expert assignment counts, summed over the last 50 steps and both MoE layers). A
PNG shows both loss curves and the per-expert load. There is no target: the issue asks for the
comparison, and 300 steps of a 3.7M model say little about GRIN at scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plait.kernels.bench import BenchRow, one_thread

STEPS, QUICK_STEPS, BATCH, SEQ, LR, BALANCE = 300, 40, 8, 64, 1e-3, 0.01
LOAD_STEPS = 50  # the expert load is summed over this many last steps
MODEL = dict(num_layers=4, hidden_size=128, num_heads=4, intermediate_size=344, num_experts=8, top_k=2)
VARIANTS = {"straight-through top-2": "straight_through", "GRIN top-2": "grin"}


def run(quick: bool) -> list[BenchRow]:
    """Train both variants and return the table's rows (see the module docstring)."""
    steps = QUICK_STEPS if quick else STEPS
    results = {}
    with one_thread():
        for name, gradient in VARIANTS.items():
            results[name] = _train(gradient, steps)
            print(f"moe-layers-quality: {name}: final loss {_final(results[name]):.4f}", flush=True)
    plot = _plot(results, quick=quick)
    return _rows(results, steps, plot)


def _train(router_gradient: str, steps: int) -> dict[str, Any]:
    from plait.kernels.testing import global_batch, tiny_llama_moe
    from plait.moe_layers import collect_losses, moe_layers
    from plait.moe_layers.tiny_llama import convert_tiny_llama_moe

    torch.manual_seed(0)
    model = tiny_llama_moe(**MODEL)
    convert_tiny_llama_moe(model, router_gradient=router_gradient)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    layers = moe_layers(model)
    losses, load = [], torch.zeros(len(layers), MODEL["num_experts"], dtype=torch.int64)
    torch.manual_seed(1)  # GRIN's draws; the same stream for both variants
    for step in range(steps):
        loss = model(**global_batch(step, BATCH, SEQ)).loss
        balance, _ = collect_losses(model)
        (loss + BALANCE * balance).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step >= steps - LOAD_STEPS:
            load += torch.stack([layer.last_losses.expert_load for layer in layers])
        if (step + 1) % 50 == 0:
            print(f"moe-layers-quality: {router_gradient} step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    return {"losses": losses, "load": load}


def _final(result: dict[str, Any]) -> float:
    tail = result["losses"][-20:]
    return sum(tail) / len(tail)


def _imbalance(result: dict[str, Any]) -> float:
    load = result["load"].double()
    return float((load.max(dim=1).values / load.mean(dim=1)).max())


def _rows(results: dict[str, dict[str, Any]], steps: int, plot: Path | None) -> list[BenchRow]:
    ours, peer = results["GRIN top-2"], results["straight-through top-2"]
    where = f"tiny-llama-MoE 3.7M, {steps} steps, E=8 top-2"
    plotted = f"; plot {plot.name}" if plot else "; no plot (matplotlib missing)"
    return [
        BenchRow(benchmark=f"{where}: final training loss", figure="loss (mean of last 20 steps)",
                 ours=_final(ours), peer="straight-through top-2", peer_value=_final(peer),
                 ratio=_final(ours) / _final(peer), note=f"first loss {ours['losses'][0]:.4f}{plotted}"),
        BenchRow(benchmark=f"{where}: expert-load imbalance",
                 figure=f"max/mean assignments (last {min(LOAD_STEPS, steps)} steps)",
                 ours=_imbalance(ours), peer="straight-through top-2", peer_value=_imbalance(peer),
                 ratio=_imbalance(ours) / _imbalance(peer),
                 note="worst of the 2 MoE layers; 1 = perfectly even"),
    ]


def _plot(results: dict[str, dict[str, Any]], *, quick: bool) -> Path | None:
    """Loss curves and per-expert load, as a PNG where the run's JSON goes
    (:func:`plait.kernels.cli.bench.plot_path`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from plait.kernels.cli.bench import plot_path

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(results)
    for index, (name, result) in enumerate(results.items()):
        curves.plot(range(1, len(result["losses"]) + 1), result["losses"], label=name, linewidth=0.8)
        load = result["load"].sum(dim=0).double()
        experts = torch.arange(load.numel()).double() + (index - (len(results) - 1) / 2) * width
        bars.bar(experts.tolist(), (load / load.sum()).tolist(), width=width, label=name)
    curves.set(xlabel="step", ylabel="training loss", title="tiny-llama-MoE, E=8 top-2")
    bars.set(xlabel="expert", ylabel=f"share of assignments (last {LOAD_STEPS} steps, both MoE layers)")
    curves.legend()
    bars.legend()
    path = plot_path("moe-layers-quality", "moe-layers-quality", quick=quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"moe-layers-quality: wrote the plot to {path}", flush=True)
    return path
