"""ZeRO++ and offload over tensor-parallel parameters (cross-package: plait-zero-sharding +
plait-offload-io): W=4 as dp2 x tp2, a two-block transformer whose Linears are colwise / rowwise
on ``tp`` and whose RMSNorms run under ``SequenceParallel`` (the model of
``packages/zero-sharding/tests/test_zero_sharding_tp.py``), ZeRO-3 over ``dp``.

One spawn of 4 ranks trains every case for 5 AdamW steps on the same global batch:

* exact algorithms, against plain ZeRO-3 at the same mesh, bitwise: hpZ with a partition of 1
  (each rank keeps the whole parameter after the forward gather, the backward gathers nothing),
  and offload of the optimizer state to CPU, and of the optimizer state and parameter shards to
  NVMe (files), every case stepping the fused CPU AdamW kernel the offloaded optimizer uses;
* quantized ones (qwZ's int8 weight gathers alone; qwZ, qgZ's int4 gradient all-to-all and hpZ together),
  against plain ZeRO-3 within the tolerance table's ``zeropp_qwz_losses`` / ``zeropp_qgz_losses``;
* every case's bytes per step on ``dp``, on ``tp`` and on the world equal to the formula: each
  unit's local (TP-shard) flat buffer per gather and reduce-scatter, as int codes plus one fp32
  scale per block where quantized; the norms' ``Partial`` gradients all-reduced over ``tp``.

The exact cases also equal one process on the whole batch within 1e-5 relative.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.kernels.testing import run_distributed
from plait.kernels.tolerances import tolerance

sys.path.insert(0, str(Path(__file__).parents[1] / "packages" / "zero-sharding" / "tests"))
from test_zero_sharding_tp import OPT, _train, build, plan, reference

# The offloaded optimizer's default CPU kernel (fused AdamW): every case steps it, so offload can be
# compared bitwise with in-memory state.
FUSED = dict(OPT, fused=True)

# case -> (ZeroPPConfig kwargs or None, offload kind or None, the exact run it must equal bitwise)
CASES = {
    "plain": (None, None, None),
    "hpz": (dict(quantized_weights=False, quantized_gradients=False, hierarchical_partition_size=1), None, "plain"),
    "qwz": (dict(quantized_gradients=False, hierarchical_partition_size=None), None, None),
    "zeropp": (dict(hierarchical_partition_size=1), None, None),
    "cpu": (None, dict(device="cpu"), "plain"),
    "nvme": (None, dict(device="nvme", param_device="nvme"), "plain"),
}


def _expected_bytes(model, zeropp, dp_name: str, tp_name: str, norm_numel: int, on_disk: int) -> dict[str, int]:
    """One step's logical bytes per group from the 2-D ZeRO++ formula (stage 3, no resident units).
    On the world: the gradient norm's fp64 sum and the overflow flag (16 B), and for each kind of
    state written to disk (``on_disk``: optimizer state, parameter shards) the ranks' agreement
    that every write succeeded (one fp32 flag, 4 B)."""
    from plait.zero_sharding.zeropp.wire import RowLayout

    def op_bytes(unit, bits: int | None) -> int:
        if bits is None:
            return unit.padded_numel * unit.full.element_size()
        return unit.group_size * RowLayout(unit.shard_numel, bits, zeropp.block_size).payload_bytes

    weight_bits = zeropp.weight_bits if zeropp is not None and zeropp.quantized_weights else None
    grad_bits = zeropp.gradient_bits if zeropp is not None and zeropp.quantized_gradients else None
    hpz_one = zeropp is not None and zeropp.hierarchical_partition_size == 1
    engine, total = model.zero_engine, 0
    for unit in engine.units:
        assert not unit.resident
        total += op_bytes(unit, weight_bits) + op_bytes(unit, grad_bits)  # forward gather, reduce
        if unit not in engine.partition.root_units and not hpz_one:
            total += op_bytes(unit, weight_bits)  # backward gather (hpZ at 1: from the kept copy)
    return {dp_name: total, tp_name: 4 * norm_numel, "world": 16 + 4 * on_disk}


def _campaign() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.kernels.collectives import ByteLedger
    from plait.offload_io import OffloadConfig, zero_placement
    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding.zeropp import ZeroPPConfig

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group = mesh["dp"].get_group()
    names = {dim: "ranks[" + ",".join(map(str, dist.get_process_group_ranks(mesh[dim].get_group()))) + "]"
             for dim in ("dp", "tp")}
    out: dict = {"losses": {}, "bytes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (zeropp, offload, _) in CASES.items():
            model = parallelize_module(build("transformer"), mesh["tp"], plan("transformer"))
            norm_numel = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
            zpp = None if zeropp is None else ZeroPPConfig(**zeropp)
            kwargs = dict(FUSED)
            if offload is not None:
                path = str(Path(tmp) / case) if offload["device"] == "nvme" else None
                kwargs["placement"] = zero_placement(OffloadConfig(path=path, **offload))
            # Threshold 0: every parameter in a gathered unit, so ZeRO++'s gathers act on all of them.
            config = ZeroConfig(stage=3, zeropp=zpp, param_persistence_threshold=0)
            model, opt = zero_shard(model, torch.optim.AdamW, config, mesh=mesh["dp"], **kwargs)
            ledger = ByteLedger()
            out["losses"][case] = _train(model, opt, dp_group, None, ledger)[0]
            measured = {g: ledger.total(group=g) for g in (names["dp"], names["tp"], "world")}
            out["bytes"][case] = (measured, _expected_bytes(model, zpp, names["dp"], names["tp"], norm_numel,
                                                               on_disk=list((offload or {}).values()).count("nvme")))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_campaign, 4, timeout=300)


@pytest.mark.timeout(330)
def test_exact_cases_equal_plain_zero_bitwise_and_one_process(results):
    ref = torch.tensor(reference("transformer", None)[0], dtype=torch.float64)
    for rank, out in enumerate(results):
        losses = out["losses"]
        for case, (_, _, same_as) in CASES.items():
            if same_as is not None:
                assert losses[case] == losses[same_as], f"{case} rank {rank}"
            if case in ("plain", "hpz", "cpu", "nvme"):
                torch.testing.assert_close(torch.tensor(losses[case], dtype=torch.float64), ref, rtol=1e-5, atol=0,
                                           msg=f"{case} rank {rank}")


@pytest.mark.timeout(330)
def test_quantized_cases_within_the_tolerance_table_of_plain_zero(results):
    for out in results:
        exact = torch.tensor(out["losses"]["plain"])
        tolerance("zeropp_qwz_losses", torch.float32).assert_close(torch.tensor(out["losses"]["qwz"]), exact)
        # all three parts: the int4 gradients dominate the difference
        tolerance("zeropp_qgz_losses", torch.float32).assert_close(torch.tensor(out["losses"]["zeropp"]), exact)
        for case in ("qwz", "zeropp"):
            assert out["losses"][case] != out["losses"]["plain"]  # the quantized path did run


@pytest.mark.timeout(330)
def test_bytes_per_mesh_dimension_equal_the_formula(results):
    for out in results:
        for case, (measured, expected) in out["bytes"].items():
            assert measured == expected, case
