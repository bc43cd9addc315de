"""A parameter group's own placement with plait-offload-io (cross-package): one group's masters and
AdamW state on NVMe (``param_groups[i]["zero_placement"]``), the other group's in memory, trains
bit for bit like everything in memory at ZeRO-2 and ZeRO-3 on 2 ranks; only that group's state
leaves memory, and the sharded checkpoint view (which reads ``optimizer.state``) is unchanged."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from plait.kernels.testing import run_distributed, tiny_llama, train_losses

pytest.importorskip("plait.offload_io")

MODEL = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300)
BATCH, SEQ, STEPS = 4, 32, 4
# fused=True on both sides: the offload placement makes AdamW fused (see tests/test_zero_offload.py).
OPT = dict(lr=1e-3, weight_decay=0.1, fused=True)


def _build(stage: int, placement=None):
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    model = tiny_llama(**MODEL)
    blocks = [p for n, p in model.named_parameters() if n.startswith("layers.")]
    others = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    second = {"params": blocks} | ({"zero_placement": placement} if placement is not None else {})
    config = ZeroConfig(stage=stage, reduce_bucket_elements=30_000)
    return zero_shard(model, torch.optim.AdamW, config, param_groups=[{"params": others}, second], **OPT)


def _session(root: str) -> dict:
    from plait.offload_io import IOConfig, OffloadConfig, zero_placement

    out = {}
    for stage in (2, 3):
        model, optimizer = _build(stage)
        reference = (train_losses(model, optimizer, STEPS, batch=BATCH, seq=SEQ),
                     copy.deepcopy(model.state_dict()),
                     {k: v.local.clone() for k, v in model.sharded_state_dict().items()})
        path = os.path.join(root, f"zero{stage}-rank{torch.distributed.get_rank()}")
        placement = zero_placement(OffloadConfig(device="nvme", path=path, sub_group_size=8192, io=IOConfig(
            block_size=65536, queue_depth=4, workers=2, fsync=False, min_free_bytes=0)))
        model, optimizer = _build(stage, placement)
        losses = train_losses(model, optimizer, STEPS, batch=BATCH, seq=SEQ)
        inner = optimizer.inner.optimizers
        # Between steps the offloaded group's state is in the files, the other group's in memory
        # (checked first: the checkpoint view below swaps the state in to read it).
        out_of_memory = not any(torch.is_tensor(v) for s in inner[1].state.values() for v in s.values())
        state = model.state_dict()
        pieces = {k: v.local.clone() for k, v in model.sharded_state_dict().items()}
        mine = {unit.key for unit in model.zero_engine.units if unit.option_index == 1}
        out[stage] = {
            "losses": losses == reference[0],
            "params": all(torch.equal(state[k], reference[1][k]) for k in reference[1]),
            "pieces": pieces.keys() == reference[2].keys() and all(torch.equal(pieces[k], reference[2][k])
                                                                   for k in pieces),
            "placement_keys": set(placement.masters()) == mine and bool(mine),
            "offloaded_out_of_memory": out_of_memory,
            "memory_group_in_memory": all(torch.is_tensor(s["exp_avg"]) for s in inner[0].state.values()),
            "files": len(os.listdir(placement.store.directory)) > 0,
        }
        placement.close()
    return out


@pytest.mark.timeout(300)
def test_one_group_on_nvme_trains_bitwise_like_all_in_memory(tmp_path) -> None:
    results = run_distributed(_session, 2, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        for stage, checks in result.items():
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, f"rank {rank} ZeRO-{stage}: {failed}"
