"""The layer runs on plait-kernels' shared MoE op units: with the Triton backend forced (the
interpreter on CPU) its output and every gradient equal the torch path's, so training goes
through the same permutation and grouped-GEMM kernels (forward and backward) as serving."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.tolerances import tolerance
from plait.moe_layers import MoE, MoEConfig


def _graph_names(tensor: torch.Tensor) -> set[str]:
    """Names of every autograd node behind ``tensor``."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "capacity"])
def test_triton_kernels_equal_the_torch_path(triton_backend, monkeypatch, capacity_factor) -> None:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(hidden_size=32, num_experts=4, intermediate_size=48, top_k=2,
                          capacity_factor=capacity_factor, min_capacity=1)).to(triton_backend)
    x = torch.randn(2, 9, 32, device=triton_backend)
    probe = torch.randn(2, 9, 32, device=triton_backend)

    def run():
        inp = x.clone().requires_grad_()
        out, losses = layer(inp, return_losses=True)
        nodes.append(_graph_names(out))
        grads = torch.autograd.grad((out * probe).sum(), [inp, *layer.parameters()])
        return out, grads, losses.dropped

    nodes: list[set[str]] = []
    out, grads, dropped = run()
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "reference")
    ref_out, ref_grads, ref_dropped = run()
    triton_nodes = {"_CombineRowsBackward", "_GroupedGatedMLPBackward", "_PermuteTokensBackward"}
    assert triton_nodes <= nodes[0] and not triton_nodes & nodes[1]  # the kernels ran, then the torch path
    assert dropped == ref_dropped and (dropped > 0) == (capacity_factor is not None)
    tolerance("moe_grouped_triton_fwd", torch.float32).assert_close(out, ref_out, what="layer output")
    for name, got, want in zip(("x", "router", "gate_up", "down"), grads, ref_grads):
        tolerance("moe_grouped_triton_bwd", torch.float32).assert_close(got, want, what=name)
