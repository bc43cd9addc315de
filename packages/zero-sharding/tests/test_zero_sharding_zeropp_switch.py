"""ZeRO++ as one field of ZeroConfig, and hpZ/qgZ sized by the launcher's nodes.

``ZeroConfig(zeropp=...)`` is what every route reads (plain ``zero_shard``, Lightning, Fabric,
the HF Trainer backend). Here: its accepted forms and refusals, DeepSpeed's three fields mapped
one to one, the node layout read from launcher variables (and refused when a node's ranks are
not consecutive), and a W=4 run where the switch builds exactly the policies the hand-built
route does, bit for bit.
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

from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard
from plait.zero_sharding.extension import DefaultGatherer, DefaultReducer
from plait.zero_sharding.zeropp import ZeroPPConfig, make_zeropp_policies
from plait.zero_sharding.zeropp.gather import HierarchicalParamGatherer, QuantizedParamGatherer
from plait.zero_sharding.zeropp.nodes import layout_from_names, node_name

STEPS, BATCH, SEQ = 3, 8, 16


def test_zeroconfig_zeropp_forms():
    assert ZeroConfig().zeropp is None and ZeroConfig(zeropp=False).zeropp is None
    assert ZeroConfig(zeropp=True).zeropp == ZeroPPConfig()
    assert ZeroConfig(zeropp={"gradient_bits": 8}).zeropp == ZeroPPConfig(gradient_bits=8)
    qgz_only = {"quantized_weights": False, "hierarchical_partition_size": None}
    assert ZeroConfig(stage=2, zeropp=qgz_only).zeropp.quantized_gradients
    with pytest.raises(ValueError, match="ZeroConfig.zeropp: .* stage=2; use stage=3"):
        ZeroConfig(stage=2, zeropp=True)
    with pytest.raises(ValueError, match="ZeroConfig.zeropp=.*weights_bits.*fields are"):
        ZeroConfig(zeropp={"weights_bits": 8})
    with pytest.raises(ValueError, match="ZeroConfig.zeropp='on' must be a ZeroPPConfig"):
        ZeroConfig(zeropp="on")
    # The config fingerprint compared across ranks sees the ZeRO++ settings.
    assert ZeroConfig(zeropp=True).fingerprint() != ZeroConfig().fingerprint()


def test_deepspeed_fields_map_one_to_one():
    assert ZeroPPConfig.from_deepspeed({"stage": 3}) is None
    assert ZeroPPConfig.from_deepspeed({"zero_hpz_partition_size": 1}) is None  # DeepSpeed's "off"
    full = ZeroPPConfig.from_deepspeed({"zero_quantized_weights": True, "zero_quantized_gradients": True,
                                        "zero_hpz_partition_size": 8})
    assert (full.quantized_weights, full.quantized_gradients, full.hierarchical_partition_size) == (True, True, 8)
    hpz = ZeroPPConfig.from_deepspeed({"zero_hpz_partition_size": 4})
    assert (hpz.quantized_weights, hpz.quantized_gradients, hpz.hierarchical_partition_size) == (False, False, 4)
    with pytest.raises(ValueError, match="zero_hpz_partition_size=0"):
        ZeroPPConfig.from_deepspeed({"zero_hpz_partition_size": 0})


def test_node_names_and_layouts():
    assert node_name({"GROUP_RANK": "1", "NODE_RANK": "0"}) == ("GROUP_RANK=1", "GROUP_RANK")
    assert node_name({"SLURM_NODEID": "3"}) == ("SLURM_NODEID=3", "SLURM_NODEID")
    assert node_name({})[1] == "hostname"
    layout = layout_from_names(["a", "a", "b", "b"], "GROUP_RANK")
    assert (layout.ranks_per_node, layout.nodes, layout.multi_node) == (2, 2, True)
    assert not layout_from_names(["a"] * 4, "hostname").multi_node
    with pytest.raises(ValueError, match=r"not consecutive.*a: ranks \[0, 2\]; b: ranks \[1, 3\]"):
        layout_from_names(["a", "b", "a", "b"], "GROUP_RANK")
    with pytest.raises(ValueError, match=r"different numbers of ranks.*a: ranks \[0, 1, 2\]; b: ranks \[3\]"):
        layout_from_names(["a", "a", "a", "b"], "NODE_RANK")


def _train(config: ZeroConfig, policies: tuple | None) -> tuple[list[float], object, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gatherer, reducer = policies if policies is not None else (None, None)
    model, optimizer = zero_shard(build_model(seed=0), torch.optim.AdamW, config, gatherer=gatherer, reducer=reducer,
                                  lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.zero_engine.gatherer, model.zero_engine.reducer


def _switch_rank(node_variable: str, interleaved: bool) -> dict:
    """Rank r believes it runs on node r // 2 (or r % 2 when ``interleaved``), as a launcher would say."""
    rank = dist.get_rank()
    os.environ[node_variable] = str(rank % 2 if interleaved else rank // 2)
    zeropp = ZeroPPConfig()
    config = ZeroConfig(stage=3, param_persistence_threshold=0, zeropp=zeropp)
    if interleaved:
        try:
            zero_shard(build_model(seed=0), torch.optim.AdamW, config, lr=1e-3)
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}
    switched, gatherer, reducer = _train(config, None)
    by_hand, _, _ = _train(ZeroConfig(stage=3, param_persistence_threshold=0),
                           make_zeropp_policies(zeropp, None))
    try:
        zero_shard(build_model(seed=0), torch.optim.AdamW, config, gatherer=DefaultGatherer(), lr=1e-3)
        both = None
    except ValueError as exc:
        both = str(exc)
    return {"switched": switched, "by_hand": by_hand, "gatherer": type(gatherer).__name__,
            "partition": getattr(gatherer, "partition_size", None),
            "node_group": dist.get_process_group_ranks(gatherer.subgroup)
            if isinstance(gatherer, HierarchicalParamGatherer) else None,
            "inner": type(getattr(gatherer, "inner", None)).__name__,
            "node_size": getattr(reducer, "node_size", None), "both": both}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("variable", ["GROUP_RANK", "SLURM_NODEID"])
def test_switch_builds_node_sized_policies(variable):
    results = run_distributed(_switch_rank, 4, variable, False, timeout=170)
    for rank, r in enumerate(results):
        assert r["switched"] == r["by_hand"], (rank, r)  # the switch is the hand-built route, bit for bit
        assert r["gatherer"] == "HierarchicalParamGatherer" and r["partition"] == 2, r
        assert r["inner"] == QuantizedParamGatherer.__name__, r
        assert r["node_group"] == [2 * (rank // 2), 2 * (rank // 2) + 1], (rank, r)
        assert r["node_size"] == 2, r  # qgZ in two hops: inside the node, then across
        assert "gatherer=/reducer= were given too" in r["both"], r
    assert results[0]["switched"][-1] < results[0]["switched"][0]


@pytest.mark.timeout(120)
def test_interleaved_nodes_are_refused_naming_the_ranks():
    results = run_distributed(_switch_rank, 4, "GROUP_RANK", True, timeout=100)
    for r in results:
        assert r["error"] and "GROUP_RANK=0: ranks [0, 2]; GROUP_RANK=1: ranks [1, 3]" in r["error"], r
        assert "ZeroPPConfig(ranks_per_node=N)" in r["error"], r


def _one_node_rank() -> dict:
    gatherer, reducer = make_zeropp_policies(ZeroPPConfig(), None)
    return {"gatherer": type(gatherer).__name__, "node_size": getattr(reducer, "node_size", None)}


@pytest.mark.timeout(90)
def test_one_node_keeps_hpz_off_and_qgz_flat():
    for r in run_distributed(_one_node_rank, 2, timeout=60):
        assert r == {"gatherer": "QuantizedParamGatherer", "node_size": None}, r


def _exact_two_hop_rank() -> dict:
    """hpZ alone and plain ZeRO-3 on two "nodes" (GROUP_RANK = rank // 2): gradients reduced exactly, in two hops."""
    from plait.kernels.collectives import ByteLedger
    from plait.zero_sharding.zeropp import HierarchicalReducer

    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank // 2)
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun says it on each of two nodes of two ranks
    torch.manual_seed(100 + rank)
    full, shard = torch.randn(4 * 37), torch.empty(37)
    reducer = HierarchicalReducer(node_size=2)
    reducer.reduce_scatter(full, shard, group=None, key="probe").wait()
    everyone = [torch.empty_like(full) for _ in range(4)]
    dist.all_gather(everyone, full)
    exact = torch.stack(everyone).sum(0)[rank * 37:(rank + 1) * 37]
    errors = []
    for bad in (1, 4, 3, True):
        try:
            HierarchicalReducer(node_size=bad)
        except ValueError as exc:
            errors.append(str(exc))
    hpz_only = ZeroConfig(stage=3, param_persistence_threshold=0, reduce_dtype=torch.float32,
                          zeropp=ZeroPPConfig(quantized_weights=False, quantized_gradients=False))
    plain = ZeroConfig(stage=3, param_persistence_threshold=0, reduce_dtype=torch.float32)
    out = {"max_err": (shard - exact).abs().max().item(), "errors": errors}
    # Plain ZeRO-3 reads the launcher's nodes too (two hops); one_hop asks for the flat collective.
    runs = (("hpz", hpz_only, None), ("plain", plain, None), ("one_hop", plain, (None, DefaultReducer())))
    for name, config, policies in runs:
        with ByteLedger() as ledger:
            out[name], _, reducer_used = _train(config, policies)
        out[f"{name}_reducer"] = type(reducer_used).__name__
        out[f"{name}_bytes"] = {f"{r.op}@{r.group}": 0 for r in ledger.records}
        for r in ledger.records:
            out[f"{name}_bytes"][f"{r.op}@{r.group}"] += r.nbytes
    return out


@pytest.mark.timeout(200)
def test_hpz_alone_reduces_exact_gradients_in_two_hops_across_nodes():
    results = run_distributed(_exact_two_hop_rank, 4, timeout=170)
    for r in results:
        assert r["max_err"] < 1e-5, r["max_err"]  # exact up to fp32 summation order
        assert len(r["errors"]) == 4 and all("node_size=" in e for e in r["errors"]), r["errors"]
        assert (r["hpz_reducer"], r["plain_reducer"], r["one_hop_reducer"]) == (
            "HierarchicalReducer", "HierarchicalReducer", "DefaultReducer")
        # Same gradients up to summation order: the curves agree to fp32 rounding.
        for name in ("hpz", "plain"):
            for got, want in zip(r[name], r["one_hop"], strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (name, r[name], r["one_hop"])
    node, cross = "ranks[0,1]", "ranks[0,2]"
    one_hop = results[0]["one_hop_bytes"]
    for name in ("hpz", "plain"):
        two = results[0][f"{name}_bytes"]
        # Hop 1 reduces every bucket inside the node (what the one-hop collective reduced over the
        # world; an all-to-all and a local sum); hop 2 sends each rank's N = 2 node sums of one
        # shard across: 1/L of hop 1's bytes.
        assert two[f"all_to_all@{node}"] == one_hop["reduce_scatter@world"], (name, two, one_hop)
        assert two[f"all_to_all@{cross}"] * 2 == two[f"all_to_all@{node}"], (name, two)
        assert "reduce_scatter@world" not in two, (name, two)
