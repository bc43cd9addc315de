"""``plait.moe_layers.deepspeed.MoE(ep_size=...)`` against DeepSpeed's own ``MoE(ep_size=...)`` on gloo:
each rank keeps the same experts as DeepSpeed's rank, and with DeepSpeed's weights loaded (its local
state dict, under its own key names) the output, ``l_aux``, ``exp_counts``, the input gradient and
every parameter gradient agree within 1e-5, with the capacity binding. W=2 is one expert-parallel
group; W=4 with ep_size=2 is two, whose expert-data-parallel pairs hold the same experts."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from plait.kernels.testing import run_distributed

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed.moe.layer")

H, E = 8, 4
CASES = {"top1_rts": dict(k=1), "top2_sampling": dict(k=2)}


def _tokens(rank: int) -> torch.Tensor:
    """This rank's tokens, most of which prefer the first experts, so the capacity binds."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 12, H, generator=gen)
    x[..., 0] += 1.5
    return x


def _worker(case: str, ep_size: int) -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as TheirMoE

    from plait.moe_layers import deepspeed as plait_ds

    rank = dist.get_rank()
    os.environ.setdefault("LOCAL_RANK", str(rank))
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo transport; skip the C++ build
    deepspeed.init_distributed(dist_backend="gloo")
    kwargs = dict(num_experts=E, ep_size=ep_size, capacity_factor=0.5, min_capacity=1) | CASES[case]
    torch.manual_seed(0)
    theirs = TheirMoE(H, nn.Sequential(nn.Linear(H, 16), nn.GELU(), nn.Linear(16, H)), **kwargs)
    theirs.set_deepspeed_parallelism()  # what deepspeed.initialize does for its MoE layers
    # Distinct experts (DeepSpeed's start as copies of one module): which expert a token reaches matters.
    with torch.no_grad():
        for index, param in enumerate(theirs.deepspeed_moe.experts.parameters()):
            param.add_(0.02 * (rank + 1) * (index + 1))
    ours = plait_ds.MoE(H, nn.Sequential(nn.Linear(H, 16), nn.GELU(), nn.Linear(16, H)), **kwargs)
    ours.load_state_dict(theirs.state_dict())  # DeepSpeed's local experts, under its own key names
    x_theirs, x_ours = _tokens(rank).requires_grad_(), _tokens(rank).requires_grad_()
    torch.manual_seed(5 + rank)
    out_t, aux_t, counts_t = theirs(x_theirs)
    torch.manual_seed(5 + rank)
    out_o, aux_o, counts_o = ours(x_ours)
    # A linear loss: its gradients do not grow with the outputs, so 1e-5 compares like with like.
    weight = torch.randn(out_t.shape, generator=torch.Generator().manual_seed(9))
    ((out_t * weight).sum() + aux_t).backward()
    ((out_o * weight).sum() + aux_o).backward()
    grads = {name: p.grad for name, p in theirs.named_parameters()}
    plait_ds._rename_deepspeed_keys(grads, "")  # DeepSpeed's names -> plait's
    return {"out": (out_o.detach(), out_t.detach()), "aux": (aux_o.detach(), aux_t.detach()),
            "counts": (counts_o, counts_t), "x_grad": (x_ours.grad, x_theirs.grad),
            "grads": {name: (p.grad, grads[name]) for name, p in ours.named_parameters()},
            "local_experts": len(ours.experts.experts), "capacity": ours.config.capacity(24, training=True)}


@pytest.mark.parametrize(("world", "case"), [(2, "top1_rts"), (2, "top2_sampling"), (4, "top2_sampling")])
def test_expert_parallel_layer_equals_deepspeeds(world: int, case: str) -> None:
    results = run_distributed(_worker, world, case, 2, timeout=180)
    for rank, got in enumerate(results):
        assert got["local_experts"] == E // 2
        torch.testing.assert_close(*got["out"], rtol=1e-5, atol=1e-6, msg=f"rank {rank} output")
        torch.testing.assert_close(*got["aux"], rtol=1e-5, atol=1e-7, msg=f"rank {rank} l_aux")
        assert torch.equal(*got["counts"]), rank
        torch.testing.assert_close(*got["x_grad"], rtol=1e-5, atol=1e-6, msg=f"rank {rank} input grad")
        for name, (ours, theirs) in got["grads"].items():
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
    assert any(int(got["counts"][1].max()) > got["capacity"] for got in results)  # the capacity binds
