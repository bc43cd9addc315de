"""``reduce_scatter_tensor(scratch_input=True)``: on gloo, an in-place all-reduce of the input.

gloo's reduce-scatter is an all-reduce of a clone of the input; reducing in the caller's scratch
input gives the same values bit for bit, counts the same bytes, and skips the clone.
"""

from __future__ import annotations

import resource

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives as C
from plait.kernels.testing import run_distributed

NUMEL = 1 << 20  # 4 MiB of fp32: the clone is 1024 fresh pages


def _rank_compare() -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    full = torch.randn(world * NUMEL, generator=gen)
    plain, scratched = torch.empty(NUMEL), torch.empty(NUMEL)
    with C.ByteLedger() as ledger:
        C.reduce_scatter_tensor(plain, full.clone(), async_op=True).wait()
        scratch = full.clone()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        handle = C.reduce_scatter_tensor(scratched, scratch, async_op=True, scratch_input=True)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        handle.wait()
        handle.wait()  # a second wait copies nothing again
        blocking = torch.empty(NUMEL)
        C.reduce_scatter_tensor(blocking, full.clone(), scratch_input=True)
    records = [(r.op, r.nbytes) for r in ledger.records]
    return {"equal": torch.equal(plain, scratched) and torch.equal(plain, blocking), "faults": faults,
            "records": records}


@pytest.mark.parametrize("world", [2, 3])
def test_scratch_reduce_scatter_is_bitwise_the_reduce_scatter(world: int) -> None:
    for result in run_distributed(_rank_compare, world, timeout=120):
        assert result["equal"]
        assert result["records"] == [("reduce_scatter", world * NUMEL * 4)] * 3
        assert result["faults"] < 256, result["faults"]  # no clone of the 4 MiB input in this thread
