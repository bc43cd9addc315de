"""Expert parallelism under ``torch.compile`` (W=2, gloo, ep_size=2): a plait MoE layer compiled
against the same layer run eagerly, over two steps of different tokens, dropless, with capacity
drops, with every token routed to one rank's experts, and with user expert modules
(:class:`ModuleExperts`, Megatron-style ``(output, bias)`` experts).

Compiled with ``fullgraph=True`` (any graph break fails the compile) and, for the capacity and
expert-module cases, also as ``model.compile()`` compiles (``fullgraph=False``: dynamo then breaks
the graph at data-dependent ops that ``fullgraph=True`` traces, such as ``bincount``). Checked: no
graph break; outputs and gradients (tokens, experts, router) within the tolerance table's
``compiled_losses_vs_eager``; no graph compiled at the second step (the routing changed, the
shapes did not); the same logical bytes counted by the ledger as eager (only kept rows travel);
the same exchanges, in the same order and under the same names, in plait's flight log.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import run_distributed
from plait.kernels.tolerances import tolerance
from plait.moe_layers import MoE, MoEConfig, apply_expert_parallel, make_expert_parallel_groups

H, I, E, TOKENS, STEPS = 8, 6, 4, 6, 2
CASES = ("dropless", "capacity", "skewed", "modules", "capacity-breaks", "modules-breaks")
"""``-breaks``: the case before it compiled with ``fullgraph=False``."""


class _Expert(torch.nn.Module):
    """A user expert returning ``(output, bias)`` as Megatron's MLPs do."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(H, I), torch.nn.Linear(I, H)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.down(torch.nn.functional.silu(self.up(x))), self.down.bias


def _layer(case: str) -> MoE:
    case = case.removesuffix("-breaks")
    options = {"capacity": {"capacity_factor": 1.0, "min_capacity": 1}}.get(case, {})
    torch.manual_seed(0)
    modules = [_Expert() for _ in range(E)] if case == "modules" else None
    layer = MoE(MoEConfig(hidden_size=H, num_experts=E, intermediate_size=I, top_k=2, **options), experts=modules)
    if case == "skewed":
        with torch.no_grad():  # every token prefers experts 0 and 1, both on rank 0
            layer.router.weight[:2] += 5.0 * torch.ones(H)
    return layer


def _step(layer: torch.nn.Module, step: int) -> dict:
    gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
    x = torch.randn(TOKENS, H, generator=gen).abs().requires_grad_()
    probe = torch.randn(TOKENS, H, generator=gen)
    collectives.clear_history()
    with ByteLedger() as ledger:
        out = layer(x)
        (out * probe).sum().backward()
    return dict(out=out.detach(), x_grad=x.grad, bytes=ledger.total(op="all_to_all"),
                log=[(event.op, event.label) for event in collectives.history()])


def _worker(case: str) -> dict:
    eager, compiled_layer = _layer(case), _layer(case)  # the same seed: the same weights
    groups = make_expert_parallel_groups(2)
    apply_expert_parallel(eager, groups)
    apply_expert_parallel(compiled_layer, groups)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=not case.endswith("-breaks"))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    steps, graphs = [], []
    for step in range(STEPS):
        steps.append((_step(eager, step), _step(compiled, step)))
        graphs.append(counters["stats"]["unique_graphs"])
    tol = tolerance("compiled_losses_vs_eager", torch.float32)
    for step, (want, got) in enumerate(steps):
        for key in ("out", "x_grad"):
            tol.assert_close(got[key], want[key], what=f"{case} step {step} {key}")
        assert got["bytes"] == want["bytes"] and got["log"] == want["log"], (step, got["log"], want["log"])
    for (name, want), got in zip(eager.named_parameters(), compiled_layer.parameters()):
        tol.assert_close(got.grad, want.grad, what=f"{case} {name}.grad (both steps)")
    return dict(graphs=graphs, breaks=sum(counters["graph_break"].values()),
                dropped=int((~eager.last_losses.kept).sum()), log=steps[0][0]["log"])


def _campaign() -> dict:
    return {case: _worker(case) for case in CASES}


@pytest.fixture(scope="module")
def campaign() -> list[dict]:
    return run_distributed(_campaign, 2, timeout=420)


@pytest.mark.parametrize("case", CASES)
def test_compiled_expert_parallel_layer_is_one_graph_equal_to_eager(campaign, case):
    for rank, results in enumerate(campaign):
        result = results[case]
        assert result["graphs"] == [1, 1], f"rank {rank}: graphs after each step {result['graphs']}"
        assert result["breaks"] == 0, f"rank {rank}: {result['breaks']} graph breaks"
        # the count exchange, rows out and back, and the two reverse exchanges of the backward
        assert len(result["log"]) == 5, result["log"]
    if case.startswith("capacity"):
        assert any(results[case]["dropped"] for results in campaign), "the capacity case dropped nothing"
