"""Gradient accumulation under ``no_sync`` with gradients offloaded (``grad_device="nvme"``).

Micro-batches accumulated without communication used to wait on every parameter's ``.grad``
until the synchronising backward: the whole model's gradient in memory, whatever the offload.
With a gradient storage each unit's flat local gradient joins its unreduced sum in the storage as
soon as the unit's backward is done, and the synchronising backward reduces that sum plus its own
gradient. The test trains tiny-llama with ZeRO-2 and ZeRO-3 at one and two ranks, two
micro-batches under ``no_sync`` and a third synchronising one per step, with the offloaded
placement and in memory (the same units), and checks:

* losses and parameters are bitwise equal (``a + b == b + a``: adding the stored sum to a new
  gradient is what autograd's accumulation computes);
* after a ``no_sync`` backward no parameter holds a gradient and no unit holds an unreduced sum
  in memory (the in-memory run holds the whole model's gradient there, which the test also
  measures, so the claim separates), and every unit's sum is in the storage.
"""

from __future__ import annotations

import os

import pytest
import torch

from plait.kernels.testing import global_batch, rank_slice, run_distributed, tiny_llama

MODEL = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300)
BATCH, SEQ, STEPS, MICRO = 4, 32, 2, 3
STAGES = {1: (3,), 2: (2, 3)}  # one rank: the stage 3 of the bigger-than-memory runs; two: both stages
OPT = dict(lr=1e-3, weight_decay=0.1, fused=True)  # the placement makes AdamW fused; so does the reference


def _build(stage: int, placement):
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    config = ZeroConfig(stage=stage, param_persistence_threshold=256)
    return zero_shard(tiny_llama(**MODEL), torch.optim.AdamW, config, placement=placement, **OPT)


def _train(model, optimizer) -> tuple[list[float], list[int]]:
    """Losses, and the gradient elements left on parameters after each step's last no_sync pass."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses, held = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            batch = rank_slice(global_batch(10 * step + micro, BATCH, SEQ), rank, world)
            if micro < MICRO - 1:
                with model.no_sync():
                    loss = model(**batch).loss
                    loss.backward()
            else:
                held.append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))
                loss = model(**batch).loss
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, held


def _session(root: str) -> dict:
    from plait.offload_io import IOConfig, OffloadConfig, zero_placement
    from plait.zero_sharding.extension import LocalPlacement

    class SameUnits(LocalPlacement):
        offloads_parameters = True  # in memory, with the units of offloaded parameters

    io = IOConfig(block_size=65536, queue_depth=4, workers=2, fsync=False, min_free_bytes=0)
    out = {}
    for stage in STAGES[torch.distributed.get_world_size()]:
        model, optimizer = _build(stage, SameUnits() if stage == 3 else None)
        ref_losses, ref_held = _train(model, optimizer)
        ref_params = {k: v.clone() for k, v in model.state_dict().items()}
        path = os.path.join(root, f"s{stage}-rank{torch.distributed.get_rank()}")
        placement = zero_placement(OffloadConfig(device="nvme", param_device="nvme" if stage == 3 else "none",
                                                 grad_device="nvme", path=path, io=io, sub_group_size=4096))
        model, optimizer = _build(stage, placement)
        engine = model.zero_engine
        losses, held = _train(model, optimizer)
        params = model.state_dict()
        # one more no_sync pass, then look at where its gradients are
        with model.no_sync():
            model(**rank_slice(global_batch(99, BATCH, SEQ), torch.distributed.get_rank(),
                               torch.distributed.get_world_size())).loss.backward()
        local = sum(key.endswith(".local") for key in engine.grad_stash.stored)
        in_memory = sum(u.local_sum is not None or u.grad_shard is not None for u in engine.units)
        optimizer.zero_grad()
        out[stage] = {"losses": losses == ref_losses, "params": params.keys() == ref_params.keys() and all(
            torch.equal(params[k], ref_params[k]) for k in params), "held": held, "ref_held": ref_held,
            "local_sums": local, "units": len(engine.units), "in_memory": in_memory,
            "cleared": not any(k.endswith(".local") for k in engine.grad_stash.stored)}
        placement.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2])
def test_no_sync_accumulates_into_the_offloaded_flat_buffer(world: int, tmp_path) -> None:
    numel = sum(p.numel() for p in tiny_llama(**MODEL).parameters())
    for rank, result in enumerate(run_distributed(_session, world, str(tmp_path), timeout=200)):
        for stage, r in result.items():
            assert r["losses"] and r["params"], (rank, stage, r)
            assert r["held"] == [0] * STEPS, (rank, stage, r)  # nothing waits on .grad
            assert r["ref_held"] == [numel] * STEPS, (rank, stage, r)  # in memory: the whole model does
            assert r["local_sums"] == r["units"] and r["in_memory"] == 0 and r["cleared"], (rank, stage, r)
