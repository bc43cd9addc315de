"""R8/R9 for moe-layers: a rank that never enters the token exchange is named, with the MoE layer.

A two-layer model with expert parallelism over two ranks runs forward and backward per step.
When one rank stops before a step (stuck, or dead), the others' first exchange times out; their
error must name that rank, the MoE layer (by its module path) and the exchange, within the job's
collective timeout (which the ep groups now take from the default group) and a few seconds more.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn

from plait.kernels import collectives
from plait.kernels.testing import Fault, run_distributed
from plait.moe_layers import MoE, MoEConfig, apply_expert_parallel, make_expert_parallel_groups

SHORT = datetime.timedelta(seconds=4)  # the job's collective timeout under test


def _model() -> nn.Module:
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=8, num_experts=4, intermediate_size=8, top_k=2)
    return nn.Sequential(nn.Linear(8, 8), MoE(config), MoE(config))


def _train_with_a_missing_rank(fault_text: str) -> tuple[str, float, str]:
    """Forward and backward per step; the fault's rank stops before step 2."""
    dist.distributed_c10d._set_pg_timeout(SHORT)  # the job's timeout, as init_process_group(timeout=) sets it
    fault = Fault.parse(fault_text)
    model = _model()
    groups = make_expert_parallel_groups(2)
    ep_timeout = str(collectives.group_timeout(groups.ep_group))
    apply_expert_parallel(model, groups)
    torch.manual_seed(dist.get_rank())
    entered = time.time()
    try:
        for step in range(4):
            collectives.set_step(step)
            x = torch.randn(6, 8)
            if fault.fires(step, dist.get_rank()):
                fault.maybe_inject(step)
                return "skipped", 0.0, ep_timeout
            entered = time.time()
            model(x).square().mean().backward()
    except collectives.CollectiveError as exc:
        assert sorted(exc.missing) == [1], exc.missing
        return str(exc), time.time() - entered, ep_timeout
    finally:
        collectives.set_step(None)
    return "finished", 0.0, ep_timeout


def test_a_rank_missing_a_token_exchange_is_named():
    (message, seconds, ep_timeout), (skipped, _, _) = run_distributed(
        _train_with_a_missing_rank, 2, "hang:rank=1:step=2:seconds=8", timeout=40)
    assert skipped == "skipped"
    assert ep_timeout == str(SHORT)  # not torch's 30-minute default for new groups
    assert message.startswith("rank 1 did not enter MoE layer `1` token-count exchange (step 2; all_to_all #")
    assert "its last collective was MoE layer `1` token dispatch all-to-all (backward) (step 1;" in message
    print(f"moe-layers: rank 1 named {seconds:.1f} s after rank 0 entered the exchange")
    assert SHORT.total_seconds() <= seconds < SHORT.total_seconds() + 4
