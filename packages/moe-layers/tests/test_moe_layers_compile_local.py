"""One rank (``ep_size=1``) under ``torch.compile``: a plait MoE layer with the stacked gated
experts and with user expert modules (:class:`ModuleExperts`), dropless and with capacity drops,
against the same layer run eagerly over two steps of different tokens.

Compiled as users compile (``model.compile()``: ``fullgraph=False``, where dynamo breaks the
graph at eager's ``nonzero`` over the kept assignments) and with ``fullgraph=True`` (where any
break fails the compile; ``ModuleExperts``' per-expert ``counts.tolist()`` did). Checked: no graph
break; outputs, token gradients and every parameter's gradient within the tolerance table's
``compiled_losses_vs_eager``; the expert load equal; one graph, none compiled at the second step
(the routing changed, the shapes did not).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.kernels.tolerances import tolerance
from plait.moe_layers import MoE, MoEConfig

H, I, E, TOKENS, STEPS = 8, 6, 4, 6, 2
CASES = [(experts, drops, fullgraph) for experts in ("gated", "modules") for drops in ("dropless", "capacity")
         for fullgraph in (False, True)]


class _Expert(nn.Module):
    """A user expert returning ``(output, bias)`` as Megatron's MLPs do."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.down(torch.nn.functional.gelu(self.up(x))), self.down.bias


def _layer(experts: str, drops: str) -> MoE:
    options = {"capacity_factor": 1.0, "min_capacity": 1} if drops == "capacity" else {}
    torch.manual_seed(0)
    modules = [_Expert() for _ in range(E)] if experts == "modules" else None
    return MoE(MoEConfig(hidden_size=H, num_experts=E, intermediate_size=I, top_k=2, **options), experts=modules)


def _step(layer: nn.Module, step: int) -> dict:
    gen = torch.Generator().manual_seed(10 * step)
    x = torch.randn(TOKENS, H, generator=gen).requires_grad_()
    probe = torch.randn(TOKENS, H, generator=gen)
    out, losses = layer(x, return_losses=True)
    (out * probe).sum().backward()
    return dict(out=out.detach(), x_grad=x.grad, load=losses.expert_load, kept=losses.kept)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("experts", "drops", "fullgraph"), CASES)
def test_compiled_local_layer_is_one_graph_equal_to_eager(experts, drops, fullgraph):
    eager, compiled_layer = _layer(experts, drops), _layer(experts, drops)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=fullgraph)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    tol = tolerance("compiled_losses_vs_eager", torch.float32)
    graphs, dropped = [], 0
    for step in range(STEPS):
        want, got = _step(eager, step), _step(compiled, step)
        graphs.append(counters["stats"]["unique_graphs"])
        for key in ("out", "x_grad"):
            tol.assert_close(got[key], want[key], what=f"{experts} {drops} step {step} {key}")
        assert torch.equal(got["load"], want["load"]) and torch.equal(got["kept"], want["kept"]), step
        dropped += int((~want["kept"]).sum())
    for (name, want), got in zip(eager.named_parameters(), compiled_layer.parameters()):
        assert got.grad is not None, f"{name} has no gradient under compile"
        tol.assert_close(got.grad, want.grad, what=f"{experts} {drops} {name}.grad (both steps)")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs == [1, 1], f"graphs after each step {graphs}"
    assert (dropped > 0) == (drops == "capacity"), f"{drops}: {dropped} assignments dropped"
