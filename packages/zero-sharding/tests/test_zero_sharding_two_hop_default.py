"""Plain ZeRO-3 reduces in two exact hops across nodes by default, and ``two_hop_reduce=False`` turns it off.

Two nodes of two ranks are emulated on gloo (W=4) in the three ways a launcher can say so: torchrun's
``GROUP_RANK`` with ``LOCAL_WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` alone with each node's own host name,
and ``ZeroConfig(ranks_per_node=2)`` given (what the Lightning strategies pass for ``num_nodes``).
Each time the first backward's reduced gradient shards equal the one-hop path's to fp32 summation
order, and the ledger's bytes per hop equal the formula: hop 1 (all-to-all inside the node) carries
each unit's padded bucket, hop 2 (across nodes) ``1 / ranks_per_node`` of it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import build_model

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard
from plait.zero_sharding.zeropp import nodes

BATCH, SEQ, NODE = 8, 16, 2
PLAIN = dict(stage=3, param_persistence_threshold=0, reduce_dtype=torch.float32)


def _first_backward(config: ZeroConfig) -> dict:
    """One backward under ``config``: the reducer, the reduced shards, bytes by op@group, the padded sizes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = zero_shard(build_model(seed=0), torch.optim.AdamW, config, lr=1e-3)
    with ByteLedger() as ledger:
        model(**rank_slice(global_batch(0, BATCH, SEQ), rank, world)).loss.backward()
    units = [u for u in model.zero_engine.units if u.trainable and not u.resident]
    sent: dict[str, int] = {}
    for r in ledger.records:
        if r.op != "all_gather":
            sent[f"{r.op}@{r.group}"] = sent.get(f"{r.op}@{r.group}", 0) + r.nbytes
    return {"reducer": type(model.zero_engine.reducer).__name__, "shards": [u.grad_shard.clone() for u in units],
            "bytes": sent, "padded": sum(u.padded_numel for u in units)}


def _rank(route: str) -> dict:
    rank = dist.get_rank()
    extra = {}
    if route == "GROUP_RANK":
        os.environ["GROUP_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank // NODE), str(NODE)
    elif route == "LOCAL_WORLD_SIZE":  # torchrun's count alone; the host names tell the nodes apart
        os.environ["LOCAL_WORLD_SIZE"] = str(NODE)
        nodes.socket.gethostname = lambda: f"node{rank // NODE}"  # type: ignore[attr-defined]
    else:
        extra = {"ranks_per_node": NODE}
    two = _first_backward(ZeroConfig(**PLAIN, **extra))
    one = _first_backward(ZeroConfig(**PLAIN, **extra, two_hop_reduce=False))
    errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(two["shards"], one["shards"], strict=True)]
    two.pop("shards"), one.pop("shards")
    return {"two": two, "one": one, "max_rel_err": max(errors)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("route", ["GROUP_RANK", "LOCAL_WORLD_SIZE", "given"])
def test_plain_zero3_reduces_in_two_hops_across_nodes(route):
    for rank, r in enumerate(run_distributed(_rank, 4, route, timeout=170)):
        assert (r["two"]["reducer"], r["one"]["reducer"]) == ("HierarchicalReducer", "DefaultReducer"), (rank, r)
        assert r["max_rel_err"] < 1e-5, (rank, r["max_rel_err"])  # the same sums, added in another order
        padded_bytes = r["two"]["padded"] * 4  # fp32 reduce dtype, every unit sharded and trainable
        node = f"ranks[{2 * (rank // NODE)},{2 * (rank // NODE) + 1}]"
        cross = f"ranks[{rank % NODE},{rank % NODE + NODE}]"
        assert r["two"]["bytes"] == {f"all_to_all@{node}": padded_bytes,
                                     f"all_to_all@{cross}": padded_bytes // NODE}, (rank, r["two"]["bytes"])
        assert r["one"]["bytes"] == {"reduce_scatter@world": padded_bytes}, (rank, r["one"]["bytes"])


def test_two_hop_fields_are_checked():
    assert ZeroConfig().two_hop_reduce is True and ZeroConfig().ranks_per_node == "auto"
    with pytest.raises(ValueError, match="ZeroConfig.two_hop_reduce='no' must be True"):
        ZeroConfig(two_hop_reduce="no")
    for bad in (0, True, "4", 2.0):
        with pytest.raises(ValueError, match="ZeroConfig.ranks_per_node=.* must be 'auto'"):
            ZeroConfig(ranks_per_node=bad)
