"""R8/R9 for onebit-optim: a rank that never enters the 1-bit exchange is named, with the exchange.

After warm-up the optimizer's ``step`` runs the 1-bit compressed all-reduce of the momentum. When
one rank stops before a step (stuck, or dead), the others' exchange times out; their error must
name that rank and the 1-bit collective, within the job's collective timeout and a few seconds more.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.testing import Fault, run_distributed
from plait.onebit_optim import OnebitAdam, OnebitAdamConfig

SHORT = datetime.timedelta(seconds=4)  # the collective timeout under test


def _train_with_a_missing_rank(fault_text: str) -> tuple[str, float]:
    """Two warm-up steps, then 1-bit steps; the fault's rank stops before step 3's optimizer step."""
    group = dist.new_group([0, 1], timeout=SHORT)
    fault = Fault.parse(fault_text)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = OnebitAdam(model.parameters(), lr=1e-2, config=OnebitAdamConfig(freeze_step=2),
                           process_group=group)
    torch.manual_seed(1 + dist.get_rank())
    entered = time.time()
    try:
        for step in range(6):
            collectives.set_step(step)
            model(torch.randn(4, 8)).square().mean().backward()
            if fault.fires(step, dist.get_rank()):
                fault.maybe_inject(step)
                return "skipped", 0.0
            entered = time.time()
            optimizer.step()
            optimizer.zero_grad()
    except collectives.CollectiveError as exc:
        assert sorted(exc.missing) == [1], exc.missing
        return str(exc), time.time() - entered
    finally:
        collectives.set_step(None)
    return "finished", 0.0


def test_a_rank_missing_the_one_bit_exchange_is_named():
    (message, seconds), (skipped, _) = run_distributed(_train_with_a_missing_rank, 2, "hang:rank=1:step=3:seconds=8",
                                                       timeout=40)
    assert skipped == "skipped"
    assert message.startswith("rank 1 did not enter OnebitAdam 1-bit exchange of param group 0: "
                              "per-tensor RMS all-reduce (step 3;")
    assert "its last collective was OnebitAdam 1-bit exchange of param group 0: 1-bit compressed all-reduce: " \
           "server-scale all-gather (step 2;" in message
    print(f"onebit-optim: rank 1 named {seconds:.1f} s after rank 0 entered the exchange")
    assert SHORT.total_seconds() <= seconds < SHORT.total_seconds() + 4
