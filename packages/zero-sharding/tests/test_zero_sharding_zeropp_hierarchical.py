"""Hierarchical qgZ on real gloo ranks: two quantized all-to-alls (inside the node, then across).

W = 4 ranks as N = 2 nodes of L = 2 (node 0 = ranks 0,1; node 1 = ranks 2,3). Every rank builds
every rank's bucket from a seed, so it can compute the exact sum of its slice and the error
bound of the module docstring on its own:

    |err| <= sum_i h(x_i) + sum_m (max|P_m| + max e1_m) / (2q)

(``h`` half a quantization step of the input's block, ``P_m`` node m's exact partial sum,
``e1_m`` its hop-1 bound, ``q`` = 7 or 127). Bytes are checked against the formulas per group:
the intra-node groups (``ranks[0,1]``, ``ranks[2,3]``) carry ``W x P``, the inter-node groups
(``ranks[0,2]``, ``ranks[1,3]``) ``N x P = W x P / L``, where the flat all-to-all carries ``W x P``
(``P`` the payload of one quantized slice).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import train_stage3_logged

from plait.kernels.collectives import ByteLedger
from plait.kernels.ops.quantize import QMAX, quantize_blockwise_reference, quantized_nbytes
from plait.kernels.testing import run_distributed
from plait.zero_sharding.extension import wait
from plait.zero_sharding.zeropp import QuantizedGradientReducer

SLACK = 2.0**-20  # relative fp32 slack on a half-step bound (one division, one rounding)
TIMEOUT = 60
WORLD = 4
# (shard, block): block-aligned slices; a partial last block; a slice smaller than one block.
SHAPES = ((512, 256), (301, 64), (77, 256))


def _data(rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2000 + rank)
    return torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen))


def _block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element: the largest magnitude of its block."""
    pad = -x.numel() % block
    maxes = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block).amax(dim=1)
    return maxes.repeat_interleave(block)[: x.numel()]


def _half_step(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Per element: half the quantization step of its block, plus the fp32 rounding of code * scale."""
    _, scales = quantize_blockwise_reference(x, bits=bits, block_size=block)
    return (scales / 2 * (1 + SLACK)).repeat_interleave(block)[: x.numel()] + x.abs() * 2.0**-22


def _bound(parts: list[torch.Tensor], bits: int, block: int, node_size: int) -> torch.Tensor:
    """The docstring's bound for the sum of ``parts`` (one per rank, in rank order)."""
    first = [_half_step(p, bits, block) for p in parts]
    bound = sum(first) + len(parts) * 2.0**-21 * torch.stack(parts).abs().sum(dim=0)
    if node_size in (1, len(parts)):
        return bound  # flat: every input quantized once
    for node in range(len(parts) // node_size):
        members = range(node * node_size, (node + 1) * node_size)
        exact_partial = sum(parts[i] for i in members)
        hop1 = sum(first[i] for i in members)
        second = (_block_max(exact_partial, block) + _block_max(hop1, block)) / (2 * QMAX[bits])
        bound = bound + second * (1 + SLACK) + exact_partial.abs() * 2.0**-22
    return bound


class _NoTranspose(QuantizedGradientReducer):
    """A deliberately wrong hop 1: sends slices in rank order (peer l' gets slices l'N..l'N+N-1)."""

    def _start_two_hops(self, full, shard_out, key):
        nodes, local = self.nodes, self.node_size
        swapped = full.reshape(local, nodes, -1).transpose(0, 1).reshape(-1)  # undone by the real transpose
        return super()._start_two_hops(swapped, shard_out, key)


def _reduce_case(world: int, rank: int, node_size: int | None, shard: int, block: int, bits: int,
                 reducer_cls: type = QuantizedGradientReducer) -> dict:
    buckets = [_data(r, world * shard) for r in range(world)]
    parts = [b[rank * shard:(rank + 1) * shard] for b in buckets]
    exact = torch.stack(parts).sum(dim=0)
    reducer = reducer_cls(bits=bits, block_size=block, node_size=node_size)
    out = torch.empty(shard)
    with ByteLedger() as ledger:
        handle = reducer.reduce_scatter(buckets[rank].clone(), out, group=None, key="b0")
        assert handle is not None
        handle.wait()
        handle.wait()  # waiting twice is harmless
    bound = _bound(parts, bits, block, node_size or world)
    err = (out - exact).abs()
    # The bound must tell this slice from every other one: a permutation of slices fails it.
    others = [torch.stack([b[r * shard:(r + 1) * shard] for b in buckets]).sum(dim=0)
              for r in range(world) if r != rank]
    discriminates = all(not bool(((out - other).abs() <= bound).all()) for other in others)
    return {"ok": bool((err <= bound).all()), "excess": float((err - bound).max()), "discriminates": discriminates,
            "rel_err": float(err.norm() / exact.norm()), "max_err_over_bound": float((err / bound).max()),
            "out": out, "by_group": ledger.by_group(), "by_op": ledger.by_op(), "count": ledger.count()}


def _group(ranks) -> str:
    return "ranks[" + ",".join(str(r) for r in ranks) + "]"


def _hierarchical_rank(world: int, node_size: int) -> dict:
    rank = dist.get_rank()
    nodes, local = world // node_size, rank % node_size
    intra = _group(range(rank // node_size * node_size, (rank // node_size + 1) * node_size))
    inter = _group(range(local, world, node_size))
    results: dict = {}
    for shard, block in SHAPES:
        for bits in (4, 8):
            flat = _reduce_case(world, rank, None, shard, block, bits)
            hier = _reduce_case(world, rank, node_size, shard, block, bits)
            name = f"int{bits}_{shard}"
            assert flat["ok"] and hier["ok"], (name, flat["excess"], hier["excess"])
            assert flat["discriminates"] and hier["discriminates"], name
            payload = quantized_nbytes(shard, bits=bits, block_size=block)  # P: one quantized slice
            # Formulas: flat W x P on the world; hop 1 W x P inside the node; hop 2 N x P = W x P / L across.
            assert flat["by_group"] == {"world": world * payload} and flat["count"] == 1
            assert hier["by_group"] == {intra: world * payload, inter: nodes * payload}, hier["by_group"]
            assert hier["by_group"][inter] * node_size == flat["by_group"]["world"]
            assert hier["by_op"] == {"all_to_all": (world + nodes) * payload} and hier["count"] == 2
            results[name] = {
                "flat_bytes": flat["by_group"]["world"], "intra_bytes": hier["by_group"][intra],
                "inter_bytes": hier["by_group"][inter],
                # Bytes that leave the node (own node's rows stay): flat (W - L) x P, hierarchical (N - 1) x P.
                "flat_cross_node": (world - node_size) * payload, "hier_cross_node": (nodes - 1) * payload,
                "flat_rel_err": flat["rel_err"], "hier_rel_err": hier["rel_err"],
                "flat_err_over_bound": flat["max_err_over_bound"], "hier_err_over_bound": hier["max_err_over_bound"],
            }
    results["bf16"] = _bf16_case(world, rank, node_size)
    # A permutation bug in hop 1 must fail the check on some rank.
    broken = _reduce_case(world, rank, node_size, 301, 64, 8, reducer_cls=_NoTranspose)
    results["broken_ok"] = broken["ok"]
    results["all_reduce"] = _all_reduce_case(world, rank, node_size, intra, inter)
    return results


def _bf16_case(world: int, rank: int, node_size: int) -> float:
    """A bf16 bucket: hop 1 quantizes bf16 rows, the node sums stay fp32, the result rounds to bf16 once."""
    shard, block = 200, 64
    buckets = [_data(r, world * shard).bfloat16() for r in range(world)]
    parts = [b[rank * shard:(rank + 1) * shard].float() for b in buckets]
    exact = torch.stack(parts).sum(dim=0)
    out = torch.empty(shard, dtype=torch.bfloat16)
    wait(QuantizedGradientReducer(bits=4, block_size=block, node_size=node_size).reduce_scatter(
        buckets[rank].clone(), out, group=None, key="bf16"))
    bound = _bound(parts, 4, block, node_size)
    err = (out.float() - exact).abs()
    assert bool((err <= bound + (exact.abs() + bound) * 2.0**-8).all()), float((err - bound).max())
    return float(err.norm() / exact.norm())


def _all_reduce_case(world: int, rank: int, node_size: int, intra: str, inter: str) -> dict:
    numel, block = 1001, 64
    tensors = [_data(10 + r, numel) for r in range(world)]
    exact = torch.stack(tensors).sum(dim=0)
    mine = tensors[rank].clone()
    reducer = QuantizedGradientReducer(bits=4, block_size=block, gather_bits=8, node_size=node_size)
    with ByteLedger() as ledger:
        reducer.all_reduce(mine, group=None, key="ar")
    shard, nodes = -(-numel // world), world // node_size
    p4, p8 = (quantized_nbytes(shard, bits=b, block_size=block) for b in (4, 8))
    # Inside the node: the hop-1 all-to-all and the last gather, W x P each; across: N x P each.
    assert ledger.by_group() == {intra: world * (p4 + p8), inter: nodes * (p4 + p8)}, ledger.by_group()
    padded = [torch.nn.functional.pad(t, (0, world * shard - numel)) for t in tensors]
    first = torch.cat([_bound([p[r * shard:(r + 1) * shard] for p in padded], 4, block, node_size)
                       for r in range(world)])
    exact_pad = torch.nn.functional.pad(exact, (0, world * shard - numel))
    # The gathered sums are quantized once more at 8 bits: half a step of (exact + first) block maxes.
    second = torch.cat([(_block_max(exact_pad[r * shard:(r + 1) * shard], block)
                         + _block_max(first[r * shard:(r + 1) * shard], block)) / (2 * QMAX[8])
                        for r in range(world)])
    bound = (first + second * (1 + SLACK))[:numel] + exact.abs() * 2.0**-21
    err = (mine - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    return {"digest": mine, "rel_err": float(err.norm() / exact.norm())}


def _flat_rank(world: int, node_size: int) -> dict:
    """node_size 1 or W: exactly today's flat all-to-all, same bits and bytes."""
    rank = dist.get_rank()
    for shard, block in SHAPES:
        for bits in (4, 8):
            today = _reduce_case(world, rank, None, shard, block, bits)
            flat = _reduce_case(world, rank, node_size, shard, block, bits)
            assert torch.equal(flat["out"], today["out"]) and flat["by_group"] == today["by_group"]
            assert flat["ok"] and flat["count"] == 1
    tensor, other = _data(rank, 1001), _data(rank, 1001)
    QuantizedGradientReducer(node_size=node_size).all_reduce(tensor, group=None, key="a")
    QuantizedGradientReducer().all_reduce(other, group=None, key="a")
    assert torch.equal(tensor, other)
    return {"hierarchical": QuantizedGradientReducer(node_size=node_size).hierarchical}


@pytest.mark.timeout(TIMEOUT + 30)
def test_two_hops_within_bound_and_inter_node_bytes_are_one_over_node_size():
    results = run_distributed(_hierarchical_rank, WORLD, WORLD, 2, timeout=TIMEOUT)
    assert not all(r["broken_ok"] for r in results), "a hop-1 permutation bug must fail the bound on some rank"
    digests = [r["all_reduce"]["digest"] for r in results]
    assert all(torch.equal(d, digests[0]) for d in digests), "all_reduce must leave every rank with the same bits"
    for name in ("int4_512", "int8_512", "int4_301"):
        row = results[0][name]
        print(f"\n{name}: flat all-to-all {row['flat_bytes']} B, hierarchical intra {row['intra_bytes']} B + inter "
              f"{row['inter_bytes']} B; leaving the node {row['flat_cross_node']} -> {row['hier_cross_node']} B; "
              f"rel err flat {row['flat_rel_err']:.4f} hier {row['hier_rel_err']:.4f}; max err/bound flat "
              f"{row['flat_err_over_bound']:.3f} hier {row['hier_err_over_bound']:.3f}")
    print(f"all_reduce rel err {results[0]['all_reduce']['rel_err']:.4f}")
    # Re-quantizing the node sums costs a little accuracy, not an order of magnitude (log-normal data).
    for row in (results[0]["int4_512"], results[0]["int8_512"]):
        assert row["hier_rel_err"] < 2 * row["flat_rel_err"]
    assert results[0]["int4_512"]["hier_rel_err"] < 0.35 and results[0]["int8_512"]["hier_rel_err"] < 0.03


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("node_size", (1, WORLD))
def test_node_size_one_or_world_is_todays_flat_all_to_all(node_size):
    results = run_distributed(_flat_rank, WORLD, WORLD, node_size, timeout=TIMEOUT)
    assert not any(r["hierarchical"] for r in results)


def _errors_rank(world: int) -> None:
    with pytest.raises(ValueError, match=r"node_size=3 does not divide the group size 4.*divisor of 4"):
        QuantizedGradientReducer(node_size=3)
    reducer = QuantizedGradientReducer(node_size=2)
    pair = dist.new_group([0, 1])  # collective: every rank creates it
    if dist.get_rank() < 2:
        with pytest.raises(ValueError, match="build one reducer per sharding group"):
            reducer.reduce_scatter(torch.zeros(8), torch.zeros(4), group=pair, key="x")


@pytest.mark.parametrize("bad", (True, 0, -2, 2.0, "2"))
def test_node_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"node_size=.* must be None \(flat\) or a positive int"):
        QuantizedGradientReducer(node_size=bad)


def test_node_size_needs_torch_distributed_and_flat_does_not():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="node_size=2 needs torch.distributed initialised"):
        QuantizedGradientReducer(node_size=2)
    assert not QuantizedGradientReducer(node_size=1).hierarchical
    assert not QuantizedGradientReducer().hierarchical


@pytest.mark.timeout(TIMEOUT + 30)
def test_node_size_not_dividing_the_group_and_a_foreign_group_are_refused():
    run_distributed(_errors_rank, WORLD, WORLD, timeout=TIMEOUT)


STEPS, BATCH, SEQ, LR = 8, 8, 16, 3e-3


def _train(reducer) -> dict:
    losses, ledger = train_stage3_logged(reducer=reducer, steps=STEPS, batch=BATCH, seq=SEQ, lr=LR)
    a2a = {r.group: 0 for r in ledger.records if r.op == "all_to_all"}
    for r in ledger.records:
        if r.op == "all_to_all":
            a2a[r.group] += r.nbytes
    return {"losses": losses, "all_to_all": a2a}


def _train_rank() -> dict:
    return {"plain": _train(None), "hier": _train(QuantizedGradientReducer(node_size=2)),
            "flat": _train(QuantizedGradientReducer())}


@pytest.mark.timeout(120)
def test_stage3_trains_with_hierarchical_qgz_like_flat_qgz():
    results = run_distributed(_train_rank, WORLD, timeout=90)
    plain, hier, flat = (results[0][k] for k in ("plain", "hier", "flat"))
    print(f"\nlosses plain {plain['losses'][0]:.3f}->{plain['losses'][-1]:.3f}, flat qgZ "
          f"{flat['losses'][0]:.3f}->{flat['losses'][-1]:.3f}, hierarchical qgZ {hier['losses'][0]:.3f}->"
          f"{hier['losses'][-1]:.3f}; all-to-all bytes flat {flat['all_to_all']} hierarchical {hier['all_to_all']}")
    # The tolerances of the flat qgZ training test (test_zero_sharding_zeropp_train.py).
    assert sum(hier["losses"][-4:]) < sum(hier["losses"][:4]) - 0.5
    assert abs(hier["losses"][-1] - plain["losses"][-1]) < 0.05 * plain["losses"][-1]
    # Rank 0's gradients cross nodes in its inter-node group at 1/L of the flat all-to-all's bytes.
    assert set(hier["all_to_all"]) == {"ranks[0,1]", "ranks[0,2]"}
    assert hier["all_to_all"]["ranks[0,2]"] * 2 == flat["all_to_all"]["world"]
    assert hier["all_to_all"]["ranks[0,1]"] == flat["all_to_all"]["world"]
