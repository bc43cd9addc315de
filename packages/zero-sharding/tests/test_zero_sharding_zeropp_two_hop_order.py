"""Two-hop reductions start their cross-node hop early, in launch order, whatever the order of waits.

W = 4 gloo ranks as N = 2 nodes of L = 2, for both two-hop reducers: qgZ
(:class:`QuantizedGradientReducer` with ``node_size=2``) and the exact
:class:`HierarchicalReducer`. Checked here:

* a bucket's hop 2 is issued by the reducer's next launch once its hop 1 has arrived, before
  anything waits on it (the byte ledger sees its inter-node all-to-all);
* every rank waiting three in-flight buckets in a different order (reverse, rotated...) neither
  deadlocks nor changes a bit: results equal launching and waiting one bucket at a time;
* the exact reducer's sums match the float64 sum within fp32 summation rounding, and the
  bytes per group are the module's formulas (``W x c`` inside the node, ``N x c`` across).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from plait.kernels.collectives import ByteLedger
from plait.kernels.ops.quantize import quantized_nbytes
from plait.kernels.testing import run_distributed
from plait.zero_sharding.zeropp import HierarchicalReducer, QuantizedGradientReducer

WORLD, NODE, SHARD, BLOCK = 4, 2, 301, 64
TIMEOUT = 90
# Per rank, the order it waits three in-flight buckets in: every rank differs.
WAIT_ORDERS = ((2, 1, 0), (0, 1, 2), (1, 0, 2), (2, 0, 1))


def _make(kind: str):
    if kind == "qgz":
        return QuantizedGradientReducer(bits=4, block_size=BLOCK, node_size=NODE)
    return HierarchicalReducer(node_size=NODE)


def _bucket(rank: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * index + rank)
    return torch.randn(WORLD * SHARD, generator=gen)


def _inter_group() -> str:
    local = dist.get_rank() % NODE
    return "ranks[" + ",".join(str(r) for r in range(local, WORLD, NODE)) + "]"


def _hop2_bytes(kind: str) -> int:
    """Logical bytes of one bucket's hop 2 (the inter-node all-to-all's input, own row included)."""
    nodes = WORLD // NODE
    return nodes * (quantized_nbytes(SHARD, bits=4, block_size=BLOCK) if kind == "qgz" else SHARD * 4)


def _early_hop2(kind: str) -> dict:
    """Launch bucket 0, let its hop 1 arrive, launch bucket 1: bucket 0's hop 2 is out before any wait."""
    reducer = _make(kind)
    outs = [torch.empty(SHARD) for _ in range(2)]
    with ByteLedger() as ledger:
        first = reducer.reduce_scatter(_bucket(dist.get_rank(), 0), outs[0], group=None, key="b0")
        deadline = time.monotonic() + 30
        while not first.first_complete():  # hop 1 is inside the node: it arrives on its own
            assert time.monotonic() < deadline, "hop 1 never completed"
            time.sleep(0.001)
        second = reducer.reduce_scatter(_bucket(dist.get_rank(), 1), outs[1], group=None, key="b1")
        inter_before_wait = ledger.by_group().get(_inter_group(), 0)
        first.wait()
        second.wait()
        inter_after = ledger.by_group().get(_inter_group(), 0)
    return {"before": inter_before_wait, "after": inter_after, "hop2": _hop2_bytes(kind)}


def _in_any_order(kind: str) -> dict:
    """Three buckets in flight, waited in this rank's order, against one bucket at a time."""
    rank = dist.get_rank()
    reducer = _make(kind)
    outs = [torch.empty(SHARD) for _ in range(3)]
    handles = [reducer.reduce_scatter(_bucket(rank, i), outs[i], group=None, key=f"b{i}") for i in range(3)]
    for index in WAIT_ORDERS[rank]:
        handles[index].wait()
    one_by_one = []
    for i in range(3):
        out = torch.empty(SHARD)
        reducer.reduce_scatter(_bucket(rank, i), out, group=None, key=f"b{i}").wait()
        one_by_one.append(out)
    same = all(torch.equal(a, b) for a, b in zip(outs, one_by_one))
    # Against the float64 sum of every rank's slice: W - 1 fp32 additions in any order stay
    # within (W - 1) half-ulps of the sum of magnitudes.
    worst = 0.0
    for i in range(3):
        parts = torch.stack([_bucket(r, i)[rank * SHARD:(rank + 1) * SHARD] for r in range(WORLD)]).double()
        bound = (WORLD - 1) * 2.0**-24 * parts.abs().sum(dim=0)
        worst = max(worst, float(((outs[i].double() - parts.sum(dim=0)).abs() / bound).max()))
    return {"same": same, "err_over_fp32_bound": worst}


def _exact_bytes() -> dict:
    with ByteLedger() as ledger:
        _make("exact").reduce_scatter(_bucket(dist.get_rank(), 0), torch.empty(SHARD), group=None, key="b").wait()
    return {"by_group": ledger.by_group(), "inter": _inter_group()}


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("kind", ["qgz", "exact"])
def test_hop2_starts_at_the_next_launch_once_hop1_arrived(kind):
    for r in run_distributed(_early_hop2, WORLD, kind, timeout=TIMEOUT):
        # Bucket 0's hop 2 was issued by bucket 1's launch (bucket 1's may have followed if its
        # hop 1 was already in); after both waits, exactly two hop 2s crossed.
        assert r["before"] in (r["hop2"], 2 * r["hop2"]), r
        assert r["after"] == 2 * r["hop2"], r


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("kind", ["qgz", "exact"])
def test_any_wait_order_gives_the_same_bits_without_deadlock(kind):
    for r in run_distributed(_in_any_order, WORLD, kind, timeout=TIMEOUT):
        assert r["same"], r
        if kind == "exact":
            assert r["err_over_fp32_bound"] <= 1.0, r  # the exact sum, added in another order
        else:
            assert r["err_over_fp32_bound"] > 100.0, r  # int4: the check can tell quantized from exact


@pytest.mark.timeout(TIMEOUT + 30)
def test_exact_two_hop_bytes_per_group():
    for rank, r in enumerate(run_distributed(_exact_bytes, WORLD, timeout=TIMEOUT)):
        node = rank // NODE
        intra = "ranks[" + ",".join(str(x) for x in range(node * NODE, node * NODE + NODE)) + "]"
        # Hop 1: the bucket reduce-scattered inside the node (W x c x 4 bytes in); hop 2: the
        # N node sums across nodes (N x c x 4): 1/L of hop 1.
        assert r["by_group"] == {intra: WORLD * SHARD * 4, r["inter"]: (WORLD // NODE) * SHARD * 4}, r
