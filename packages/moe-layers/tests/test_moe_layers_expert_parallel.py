"""Expert parallelism on gloo: EP=2 and EP=4 (and dp=2 x ep=2) against one process running the
same layer on every rank's tokens: outputs, expert and router gradients (also with GRIN's router);
all-to-all bytes per layer against the formula; dropless under extreme imbalance; bad ep sizes
refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from plait.kernels.collectives import ByteLedger
from plait.kernels.mesh import make_mesh
from plait.kernels.testing import run_distributed
from plait.kernels.tolerances import tolerance
from plait.moe_layers import (
    MoE,
    MoEConfig,
    apply_expert_parallel,
    average_gradients,
    dense_parameters,
    expert_parameters,
    make_expert_parallel_groups,
)

H, I, E, TOKENS = 8, 6, 8, 12


def _layer(case: str) -> MoE:
    options = {"capacity": {"capacity_factor": 1.0, "min_capacity": 1}, "dropless": {}, "skewed": {},
               "grin": {"router_gradient": "grin"}}[case]
    torch.manual_seed(0)
    layer = MoE(MoEConfig(hidden_size=H, num_experts=E, intermediate_size=I, top_k=2, **options))
    if case == "skewed":
        with torch.no_grad():  # every token prefers experts 0 and 1: one rank gets all the rows
            layer.router.weight[:2] += 5.0 * torch.ones(H)
    return layer


def _inputs(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(world, TOKENS, H, generator=gen).abs(), torch.randn(world, TOKENS, H, generator=gen))


def _ep_worker(case: str, ep_size: int, use_mesh: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tol = tolerance("moe_expert_parallel", torch.float32)
    layer = _layer(case)
    reference = copy.deepcopy(layer)
    mesh = make_mesh(dp=world // ep_size, ep=ep_size) if use_mesh else None
    groups = make_expert_parallel_groups(ep_size, mesh=mesh)
    apply_expert_parallel(layer, groups)
    assert layer.experts.local_experts == E // ep_size
    xs, probes = _inputs(world)
    ref_xs = xs.clone().requires_grad_()
    x = xs[rank].clone().requires_grad_()  # as after earlier layers: the tokens need gradients too
    # GRIN samples its experts from torch's generator: each rank draws for its own tokens, so the
    # one-process reference seeds the same way before each rank's tokens.
    torch.manual_seed(100 + rank)
    with ByteLedger() as ledger:
        out, losses = layer(x, return_losses=True)
        (out * probes[rank]).sum().backward()
    ref_loss = 0.0
    for r in range(world):  # one process: the same layer on every rank's tokens, one after another
        torch.manual_seed(100 + r)
        ref_out = reference(ref_xs[r])
        ref_loss = ref_loss + (ref_out * probes[r]).sum()
        if r == rank:
            torch.testing.assert_close(out, ref_out, atol=tol.atol, rtol=tol.rtol)
    ref_loss.backward()
    torch.testing.assert_close(x.grad, ref_xs.grad[rank], atol=tol.atol, rtol=tol.rtol)
    average_gradients(layer, groups)
    local = slice(groups.ep_rank * (E // ep_size), (groups.ep_rank + 1) * (E // ep_size))
    ref_experts = [reference.experts.gate_up_proj.grad[local], reference.experts.down_proj.grad[local]]
    for got, want in zip(expert_parameters(layer), ref_experts):
        torch.testing.assert_close(got.grad * world, want, atol=tol.atol, rtol=tol.rtol)
    for got, want in zip(dense_parameters(layer), dense_parameters(reference)):
        torch.testing.assert_close(got.grad * world, want.grad, atol=tol.atol, rtol=tol.rtol)
    # Bytes: rows sent S = this rank's kept assignments; rows received R = what the ep group's
    # ranks routed to this rank's experts (read with a plain all_gather, outside the ledger).
    loads = [torch.empty_like(losses.expert_load) for _ in range(world)]
    dist.all_gather(loads, losses.expert_load)
    ep_peers = range(rank - groups.ep_rank, rank - groups.ep_rank + ep_size)
    sent, received = int(losses.expert_load.sum()), sum(int(loads[p][local].sum()) for p in ep_peers)
    a2a = ledger.total(op="all_to_all")
    assert a2a == 8 * E + 2 * (sent + received) * H * 4, (a2a, sent, received)
    assert ledger.count("all_to_all") == 5  # counts, rows out, rows back; two reverse exchanges
    return {"sent": sent, "received": received, "dropped": losses.dropped}


@pytest.mark.parametrize(("case", "world", "ep_size", "use_mesh"), [
    ("dropless", 2, 2, False),
    ("capacity", 4, 4, False),
    ("skewed", 4, 2, True),
    ("grin", 2, 2, False),  # GRIN's sampled top-2 under EP, dropless, router gradient summed over ranks
])
def test_expert_parallel_equals_one_process(case: str, world: int, ep_size: int, use_mesh: bool) -> None:
    results = run_distributed(_ep_worker, world, case, ep_size, use_mesh, timeout=120)
    if case == "capacity":
        assert sum(r["dropped"] for r in results) > 0
    if case == "grin":
        assert all(r["dropped"] == 0 for r in results)  # GRIN's top-2 drops no token
    if case == "skewed":
        # Dropless at any imbalance: every assignment ran, and the rank owning experts 0-1 got them all.
        assert all(r["dropped"] == 0 for r in results)
        assert results[0]["received"] == sum(r["sent"] for r in results[:2])


def _pyramid_worker() -> list[int]:
    """Pyramid MoE: layers with 4 and 8 experts, both sharded by ep=2, equal to one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(MoE(MoEConfig(hidden_size=H, num_experts=e, intermediate_size=I)) for e in (4, 8)))
    reference = copy.deepcopy(model)
    apply_expert_parallel(model, make_expert_parallel_groups(2))
    x = _inputs(2)[0][dist.get_rank()]
    torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-4)
    return [layer.experts.local_experts for layer in model]


def test_pyramid_moe_expert_parallel() -> None:
    assert run_distributed(_pyramid_worker, 2, timeout=60) == [[2, 4], [2, 4]]


def _bad_ep_worker() -> list[str]:
    messages = []
    for build in (lambda: make_expert_parallel_groups(3),
                  lambda: apply_expert_parallel(MoE(MoEConfig(hidden_size=H, num_experts=3, intermediate_size=I)),
                                                make_expert_parallel_groups(2))):
        try:
            build()
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_bad_ep_sizes_refused() -> None:
    messages = run_distributed(_bad_ep_worker, 2, timeout=60)[0]
    assert len(messages) == 2
    assert "ep_size=3 must be a positive int dividing the world size 2" in messages[0]
    assert "num_experts=3 is not divisible by ep_size=2" in messages[1]
