"""The optimizer step's post-step all-gathers: resident units (stages 1/2, stage 3's small
parameters) gather their shard in place with the default gatherer (no copy of the shard), the
gathers are pipelined, and training is bitwise what it is with a gatherer that gets a copy."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard
from plait.zero_sharding.extension import DefaultGatherer

sys.path.insert(0, os.path.dirname(__file__))
from zero_test_support import OPT, Variant, build_model, train_ranks


class CopyingGatherer(DefaultGatherer):
    """The default all-gather under another type: the step then hands it a copy of the shard."""


def _train(stage: int, gatherer: object) -> tuple[list[float], dict[str, torch.Tensor], int]:
    config = ZeroConfig(stage=stage, param_persistence_threshold=0 if stage < 3 else 10_000)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, gatherer=gatherer, **OPT)
    losses = train_ranks(model, optimizer, Variant(steps=3))
    model(**{k: v[:2] for k, v in _batch().items()}).loss.backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer.step()
    clones = sum(1 for e in prof.events() if e.name == "aten::clone" and _under_step(e))
    with torch.no_grad():
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return losses, state, clones


def _under_step(event: object) -> bool:
    """Inside the step and not inside a collective (gloo's reduce-scatter, which stage 1 runs in
    the step, clones its input itself)."""
    node = event.cpu_parent
    while node is not None:
        if node.name.startswith("c10d::"):
            return False
        if node.name == "plait::zero::step":
            return True
        node = node.cpu_parent
    return False


def _batch() -> dict[str, torch.Tensor]:
    from plait.kernels.testing import global_batch

    return global_batch(99, 4, 16)


def _compare() -> dict[int, tuple[bool, int, int]]:
    out = {}
    for stage in (2, 3):  # stage 1 gathers its resident units through the same path as stage 2
        losses, state, clones = _train(stage, None)
        ref_losses, ref_state, ref_clones = _train(stage, CopyingGatherer())
        same = losses == ref_losses and all(torch.equal(state[k], ref_state[k]) for k in ref_state)
        out[stage] = (same, clones, ref_clones)
    dist.barrier()
    return out


def test_post_step_gathers_copy_nothing_and_match_bitwise() -> None:
    for rank_result in run_distributed(_compare, 2, timeout=240):
        for stage, (same, clones, ref_clones) in rank_result.items():
            assert same, f"stage {stage}: in-place post-step gathers changed the training"
            assert clones == 0, f"stage {stage}: {clones} shard copies in the step with the default gatherer"
            assert ref_clones > 0  # the other gatherer still gets its copy (the comparison means something)
