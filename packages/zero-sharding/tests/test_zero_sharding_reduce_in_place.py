"""Stages 2/3 hand gloo their own flat gradient bucket to reduce in place: gloo's reduce-scatter
(an all-reduce of a copy of its input) then copies no bucket on the training thread, the ledger
still counts a reduce-scatter of the bucket, and training is bitwise what it is when the bucket
goes through the reduce-scatter that copies it (a reducer of another type), at W=2 and W=4."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import global_batch, run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard
from plait.zero_sharding.extension import DefaultReducer

sys.path.insert(0, os.path.dirname(__file__))
from zero_test_support import OPT, Variant, build_model, train_ranks


class CopyingReducer(DefaultReducer):
    """The default reduce-scatter under another type: the engine then keeps its bucket intact."""


def _train(stage: int, reducer: object) -> tuple[list[float], dict[str, torch.Tensor], int, dict[str, int]]:
    config = ZeroConfig(stage=stage, param_persistence_threshold=0, reduce_bucket_elements=20_000)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, reducer=reducer, **OPT)
    losses = train_ranks(model, optimizer, Variant(steps=3))
    with ByteLedger() as ledger, profile(activities=[ProfilerActivity.CPU]) as prof:
        model(**{k: v[:4] for k, v in global_batch(99, 4 * dist.get_world_size(), 16).items()}).loss.backward()
        optimizer.step()
    # A copy of a whole bucket made inside a collective, on this thread: gloo's input copy.
    copies = sum(1 for e in prof.events() if e.name == "aten::clone" and _in_collective(e))
    with torch.no_grad():
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return losses, state, copies, ledger.by_op()


def _in_collective(event: object) -> bool:
    node = event.cpu_parent
    while node is not None:
        if node.name.startswith("c10d::"):
            return True
        node = node.cpu_parent
    return False


def _compare() -> dict[int, dict]:
    out = {}
    for stage in (2, 3):
        losses, state, copies, sent = _train(stage, None)
        ref_losses, ref_state, ref_copies, ref_sent = _train(stage, CopyingReducer())
        same = losses == ref_losses and all(torch.equal(state[k], ref_state[k]) for k in ref_state)
        out[stage] = {"same": same, "copies": copies, "ref_copies": ref_copies, "sent": sent, "ref_sent": ref_sent}
    dist.barrier()
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_buckets_reduce_in_place_bitwise(world: int) -> None:
    for rank_result in run_distributed(_compare, world, timeout=360):
        for stage, r in rank_result.items():
            assert r["same"], f"stage {stage}: reducing the bucket in place changed the training"
            assert r["copies"] == 0, f"stage {stage}: {r['copies']} bucket copies inside collectives"
            assert r["ref_copies"] > 0, r  # the other reducer still copies (the comparison means something)
            assert r["sent"] == r["ref_sent"] and r["sent"]["reduce_scatter"] > 0, r  # the same logical bytes
