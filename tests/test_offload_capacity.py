"""The capacity benchmark's machinery (``plait.offload_io.benchmarks.capacity``) on a small
decoder: each variant climbs the depth ladder under a cap, a cgroup cap kills a process that
does not fit, and the rows report the largest model with its peak and losses. And what lets
ZeRO-Infinity fit on one rank, with resident-set bounds: construction under ``sharded_init``
holding each value once, shards whose memory is returned once written, the embedding and the
head as units of their own."""

from __future__ import annotations

import math

import pytest
import torch

from plait.kernels.testing import run_distributed, tiny_llama, train_losses
from plait.offload_io.benchmarks import capacity

SHAPE = dict(vocab=512, dim=128, heads=2, ffn=256)


@pytest.mark.timeout(300)
def test_capacity_rows_on_a_small_family(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(capacity, "QUICK_SHAPE", SHAPE)
    monkeypatch.setattr(capacity, "QUICK_START", 1)
    monkeypatch.setattr(capacity, "QUICK_CLIMB", (2,))
    monkeypatch.setattr(capacity, "QUICK_CAP_BYTES", 2 << 30)
    monkeypatch.setattr(capacity, "FAMILIES", ("hf",))  # the other families run the same code path
    monkeypatch.setenv("PLAIT_OFFLOAD_BENCH_DIR", str(tmp_path))
    pytest.importorskip("transformers")
    rows = capacity.run(True)
    largest = {r.benchmark.split(": ", 1)[1]: r for r in rows if r.figure == "largest model (M params)"}
    budget = largest[f"{capacity.FAMILY_LABELS['hf']}, {capacity.VARIANT_LABELS['budget']}"]
    plain = largest[f"{capacity.FAMILY_LABELS['bench']}, {capacity.VARIANT_LABELS['memory']}"]
    for row in (budget, plain):  # 2 GiB holds these models in every variant
        assert row.ours > 0 and "losses" in row.note, row
    assert "2 layers" in budget.note and "chose sub_group_size" in budget.note, budget
    ratio = next(r for r in rows if r.figure == "peak RSS (GiB)")
    assert ratio.ratio == pytest.approx(ratio.ours / ratio.peer_value) and ratio.passed is False
    step = next(r for r in rows if r.figure == "time (s)")
    assert step.ours > 0 and math.isfinite(step.ratio)
    overall = largest["largest model trained, any family"]
    assert overall.ours == budget.ours and overall.passed is False


@pytest.mark.timeout(120)
@pytest.mark.skipif(not capacity._cgroup_available(), reason="needs root and a cgroup v1 memory controller")
def test_a_cgroup_cap_stops_a_model_that_does_not_fit(tmp_path) -> None:
    assert capacity._try("bench", "memory", 1, SHAPE, str(tmp_path), 64 << 20) is None
    fitted = capacity._try("bench", "memory", 1, SHAPE, str(tmp_path), 2 << 30)
    assert fitted is not None and fitted["falling"] and fitted["peak_rss"] < 2 << 30


@pytest.mark.timeout(60)
@pytest.mark.skipif(not capacity._cgroup_available(), reason="needs root and a cgroup v1 memory controller")
def test_a_fractional_budget_reads_the_process_own_cgroup() -> None:
    """A process inside a child cgroup (not the one a container shows at the mount point) sizes
    ``memory_budget="0.5"`` from its own group's limit."""
    import subprocess
    import sys

    code = "from plait.offload_io.budget import parse_budget; print(parse_budget('0.5'))"
    with capacity._capped(768 << 20) as enter:
        out = subprocess.run(enter + [sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == 384 << 20


# A decoder whose embedding and head (16000 x 512 = 32 MiB each) dominate, as in the benchmark's
# family: the memory bounds below are about them.
STREAMED = dict(vocab_size=16000, hidden_size=512, num_heads=4, intermediate_size=1376, max_seq_len=64, num_layers=2)


def streaming_memory_session(root: str) -> dict:
    """One rank: resident-set figures (bytes over the start) of building the decoder under
    ``sharded_init`` and sharding it with everything on disk; then 2 steps' losses and the weights
    next to in-memory ZeRO-3 built normally from the same seed."""
    import os

    from plait.kernels.bench import reset_peak_rss, rss_bytes
    from plait.offload_io import IOConfig, OffloadConfig, zero_placement
    from plait.zero_sharding import ZeroConfig, sharded_init, zero_shard

    def train(model, optimizer) -> list[float]:
        return train_losses(model, optimizer, 2, batch=1, seq=32)

    torch.manual_seed(0)
    reference, ref_opt = zero_shard(tiny_llama(**STREAMED), torch.optim.AdamW, ZeroConfig(stage=3), lr=1e-3,
                                    fused=True)
    ref_losses, ref_weights = train(reference, ref_opt), reference.state_dict()
    del reference, ref_opt
    model_bytes = sum(v.numel() * 4 for v in ref_weights.values())
    io = IOConfig(block_size=1 << 20, queue_depth=4, workers=2, fsync=False, min_free_bytes=0)
    placement = zero_placement(OffloadConfig(device="nvme", param_device="nvme", grad_device="nvme", io=io,
                                             path=os.path.join(root, "rank0"), sub_group_size=1 << 18))
    start = reset_peak_rss()
    torch.manual_seed(0)
    with sharded_init():
        model = tiny_llama(**STREAMED)
    build = rss_bytes()[1] - start
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, lr=1e-3)
    after_shard = rss_bytes()[0] - start
    losses = train(model, optimizer)
    weights = model.state_dict()
    placement.close()
    return {"model_bytes": model_bytes, "build": build, "after_shard": after_shard,
            "losses": losses == ref_losses, "weights": all(torch.equal(weights[k], v) for k, v in ref_weights.items()),
            "units": {u.key: [s.name for s in u.slots] for u in model.zero_engine.partition.root_units}}


@pytest.mark.timeout(300)
def test_streamed_construction_and_separate_units_train_bitwise(tmp_path) -> None:
    """One rank, everything on disk, built under ``sharded_init`` with the embedding, norm and head
    as units of their own: losses and weights bitwise those of in-memory ZeRO-3.

    The session also returns its resident-set figures (build, after ``zero_shard``), but they are
    not asserted: over runs on the same commit they ranged from 1.16x to 2.4x the model for the
    build and 0.77x to 3.1x after sharding, with the order of the runs in the process and the
    disk's write-back state, so no bound was both meaningful and stable. The memory claim is the
    capacity benchmark's (217M parameters trained inside a 1.25 GiB cgroup)."""
    result = run_distributed(streaming_memory_session, 1, str(tmp_path), timeout=240,
                             env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})[0]
    assert result["losses"] and result["weights"], result
    assert result["units"] == {}, result  # embedding, norm and head are units of their own
