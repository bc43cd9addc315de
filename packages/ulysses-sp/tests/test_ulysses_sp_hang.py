"""R8/R9 for ulysses-sp: a rank that never enters a Ulysses all-to-all is named, with the exchange.

Each step runs DistributedAttention forward and backward (four all-to-alls each way). When one
rank stops before a step (stuck, or dead), the others' first all-to-all times out; their error
must name that rank and the exchange, within the collective timeout and a few seconds more.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.testing import Fault, run_distributed
from plait.ulysses_sp import DistributedAttention

SHORT = datetime.timedelta(seconds=4)  # the collective timeout under test


def _attention_with_a_missing_rank(fault_text: str) -> tuple[str, float]:
    """Forward and backward of Ulysses attention per step; the fault's rank stops before step 2."""
    group = dist.new_group([0, 1], timeout=SHORT)
    fault = Fault.parse(fault_text)
    attention = DistributedAttention(mesh=group)
    torch.manual_seed(dist.get_rank())
    entered = time.time()
    try:
        for step in range(4):
            collectives.set_step(step)
            q, k, v = (torch.randn(1, 4, 8, 8, requires_grad=True) for _ in range(3))
            if fault.fires(step, dist.get_rank()):
                fault.maybe_inject(step)
                return "skipped", 0.0
            entered = time.time()
            attention(q, k, v, is_causal=True).sum().backward()
    except collectives.CollectiveError as exc:
        assert sorted(exc.missing) == [1], exc.missing
        return str(exc), time.time() - entered
    finally:
        collectives.set_step(None)
    return "finished", 0.0


def test_a_rank_missing_a_ulysses_all_to_all_is_named():
    (message, seconds), (skipped, _) = run_distributed(_attention_with_a_missing_rank, 2,
                                                       "hang:rank=1:step=2:seconds=8", timeout=40)
    assert skipped == "skipped"
    assert message.startswith("rank 1 did not enter Ulysses all-to-all of q, sequence to heads (step 2; all_to_all #")
    assert "its last collective was Ulysses all-to-all of " in message and "(backward) (step 1;" in message
    print(f"ulysses-sp: rank 1 named {seconds:.1f} s after rank 0 entered the all-to-all")
    assert SHORT.total_seconds() <= seconds < SHORT.total_seconds() + 4
