"""ZeRO-Offload through plait-zero-sharding: offloaded training is bitwise equal to in-memory training.

Each world size runs one session (process start-up dominates on 2 cores): the default placement
and every offloaded variant train the same tiny-llama for STEPS fp32 AdamW steps; losses, final
parameters and optimizer state must be equal bit for bit, for ZeRO-2 and ZeRO-3, CPU and NVMe
(files in a per-rank temporary directory), with and without Twin-Flow (offload_ratio=0.5), and
for bf16 compute with fp32 masters. NVMe state must also survive ``ZeroOptimizer.state_dict`` /
``load_state_dict`` (resume) and the sharded checkpoint view, which reads ``optimizer.state``
directly. A rank whose writes fail (``RLIMIT_FSIZE``) makes every rank raise, none hangs.
"""

from __future__ import annotations

import copy
import os
import signal
import sys

import pytest
import torch

from plait.kernels.testing import global_batch, run_distributed, tiny_llama, train_losses

MODEL = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300)
BATCH, SEQ, STEPS = 4, 32, 4
# fused=True on both sides: the placement makes AdamW fused unless told otherwise (the fastest CPU
# kernel), and fused differs from the foreach default in the last bits.
OPT = dict(lr=1e-3, weight_decay=0.1, fused=True)
# Small sub-groups so a step streams several through the store's three slots.
SUB_GROUP = 8192
BUCKET = 30_000
VARIANTS = [(2, "cpu", 1.0), (2, "nvme", 1.0), (3, "cpu", 1.0), (3, "nvme", 1.0), (2, "cpu", 0.5), (3, "nvme", 0.5)]
# bf16 compute with fp32 masters: read_master casts the host master into the bf16 shard.
BF16_VARIANTS = [(3, "nvme", 1.0)]


def _offload(device: str, root: str, ratio: float = 1.0):
    from plait.offload_io import IOConfig, OffloadConfig

    io = IOConfig(block_size=65536, queue_depth=4, workers=2, fsync=False, min_free_bytes=0)
    path = os.path.join(root, f"rank{torch.distributed.get_rank()}") if device == "nvme" else None
    return OffloadConfig(device=device, path=path, sub_group_size=SUB_GROUP, offload_ratio=ratio, io=io)


def _build(stage: int, placement=None, dtype: torch.dtype = torch.float32):
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    model = tiny_llama(**MODEL)
    # Stage-2 units are reduce buckets; several of them give the store several sub-groups to stream.
    config = ZeroConfig(stage=stage, reduce_bucket_elements=BUCKET, compute_dtype=dtype)
    return zero_shard(model, torch.optim.AdamW, config, placement=placement, **OPT)


def _train(model, optimizer, steps: int = STEPS, start: int = 0) -> list[float]:
    return train_losses(model, optimizer, steps, batch=BATCH, seq=SEQ, start=start)


def _params(model) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _pieces(model) -> dict[str, torch.Tensor]:
    return {name: piece.local.clone() for name, piece in model.sharded_state_dict().items()}


def _inner_state(optimizer) -> dict:
    return optimizer.state_dict()["inner"]["state"]


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x)
        for x, y in ((a[i], b[i]) for i in a))


def offload_session(root: str) -> dict:
    """Every variant on this rank; returns booleans and figures (module level for run_distributed)."""
    from plait.offload_io import zero_placement

    out: dict = {}
    reference = {}
    for stage in (2, 3):
        model, optimizer = _build(stage)
        losses = _train(model, optimizer)
        # Deep copies: torch's state_dict shares tensors with the live optimizer (and a loaded one).
        state = copy.deepcopy(optimizer.state_dict())
        pieces = _pieces(model)
        reference[stage] = (losses, _params(model), state["inner"]["state"], state, pieces,
                            _train(model, optimizer, 1, STEPS), _params(model))
    for stage, device, ratio in VARIANTS:
        placement = zero_placement(_offload(device, root, ratio))
        model, optimizer = _build(stage, placement)
        losses = _train(model, optimizer)
        ref_losses, ref_params, ref_state, _, ref_pieces, ref_next, ref_next_params = reference[stage]
        params = _params(model)
        name = f"zero{stage}-{device}-{ratio}"
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        out[name] = {
            "losses": losses == ref_losses,
            "params": params.keys() == ref_params.keys() and all(torch.equal(params[k], ref_params[k])
                                                                    for k in params),
            # NVMe: between steps no optimizer tensor is left in memory, it is all in the files, and
            # the fp32 masters hold 4-byte placeholders (checked before anything reads them).
            "state_out_of_memory": device != "nvme" or not any(
                torch.is_tensor(v) for s in optimizer.inner.state.values() for v in s.values()) or ratio < 1.0,
            "masters_out_of_memory": device != "nvme" or ratio < 1.0 or all(
                m.untyped_storage().nbytes() <= 4 for m in masters),
            "state": _same_state(_inner_state(optimizer), ref_state),
            "masters_on_host": all(m.device.type == "cpu" and m.data_ptr() not in
                                   {u.shard.data_ptr() for u in model.zero_engine.units}
                                   for m in placement.masters().values()) if ratio == 1.0 else True,
            "offloaded": placement.offloaded_elements,
            "total": sum(m.numel() for m in masters),
        }
        if device == "nvme":
            # One file per offloaded sub-group: the state really streams through several.
            out[name]["files"] = len(os.listdir(placement.store.directory))
            with placement.materialized():
                out[name]["materialized"] = sum(torch.is_tensor(v) for s in optimizer.inner.state.values()
                                                for v in s.values())
            # The sharded checkpoint reads optimizer.state directly: the entries swap themselves in,
            # and the next step stores them again.
            pieces = _pieces(model)
            out[name]["pieces"] = pieces.keys() == ref_pieces.keys() and all(
                torch.equal(pieces[k], ref_pieces[k]) for k in pieces)
            next_params = (_train(model, optimizer, 1, STEPS), _params(model))
            out[name]["after_pieces"] = next_params[0] == ref_next and all(
                torch.equal(next_params[1][k], ref_next_params[k]) for k in ref_next_params)
            out[name]["state_out_again"] = ratio < 1.0 or not any(
                torch.is_tensor(v) for s in optimizer.inner.state.values() for v in s.values())
        if device == "nvme" and stage == 3 and ratio == 1.0:
            # Resume: load the reference's optimizer state into a fresh NVMe run and go on.
            fresh_placement = zero_placement(_offload(device, root))
            fresh, fresh_opt = _build(stage, fresh_placement)
            fresh_opt.load_state_dict(copy.deepcopy(reference[stage][3]))
            ref_model, ref_opt = _build(stage)
            ref_opt.load_state_dict(copy.deepcopy(reference[stage][3]))
            out["resume"] = _train(fresh, fresh_opt, 2, STEPS) == _train(ref_model, ref_opt, 2, STEPS)
            fresh_placement.close()
        placement.close()
    for stage, device, ratio in BF16_VARIANTS:
        runs = []
        for placement in (None, zero_placement(_offload(device, root, ratio))):
            model, optimizer = _build(stage, placement, torch.bfloat16)
            runs.append((_train(model, optimizer), _params(model)))
            if placement is not None:
                placement.close()
        (ref_losses, ref_params), (losses, params) = runs
        out[f"bf16-zero{stage}-{device}-{ratio}"] = {
            "losses": losses == ref_losses,
            "params": all(torch.equal(params[k], ref_params[k]) for k in ref_params)}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_training_is_bitwise_equal_to_in_memory(world: int, tmp_path) -> None:
    results = run_distributed(offload_session, world, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        assert result.pop("resume") is True, rank
        for name, checks in result.items():
            assert checks["losses"] and checks["params"], (rank, name, checks)
            if name.startswith("bf16"):
                continue
            assert checks["state"], (rank, name, checks)
            assert checks["masters_on_host"] and checks["state_out_of_memory"], (rank, name, checks)
            assert checks["masters_out_of_memory"], (rank, name, checks)
            if "nvme" in name:
                assert checks["files"] > 1 and checks["materialized"] > 0, (rank, name, checks)
                assert checks["pieces"] and checks["after_pieces"] and checks["state_out_again"], (rank, name, checks)
            if name.endswith("-0.5"):
                assert 0 < checks["offloaded"] < checks["total"], (rank, name, checks)
            else:
                assert checks["offloaded"] == checks["total"], (rank, name, checks)
    assert not any(os.scandir(tmp_path / "rank0")), "closing the placement removes its files"


def disk_full_session(root: str) -> str:
    """Rank 1 may write almost nothing; every rank must see OffloadDiskFullError, none may hang."""
    import resource

    from plait.offload_io import OffloadDiskFullError, zero_placement

    placement = zero_placement(_offload("nvme", root))
    model, optimizer = _build(2, placement)
    if torch.distributed.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() returns EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        _train(model, optimizer, 1)
    except OffloadDiskFullError as exc:
        return type(exc).__name__
    finally:
        placement.close()
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE/SIGXFSZ semantics are Linux's")
def test_disk_full_on_one_rank_raises_on_every_rank(tmp_path) -> None:
    assert run_distributed(disk_full_session, 2, str(tmp_path), timeout=90) == ["OffloadDiskFullError"] * 2


def read_ahead_session(root: str) -> tuple[bool, bool, int]:
    """overlap_io: when a backward begins, the placement starts reading its first sub-group."""
    from plait.offload_io import zero_placement

    placement = zero_placement(_offload("nvme", root))
    model, optimizer = _build(3, placement)
    _train(model, optimizer, 1)
    first = next(sg.id for sg in placement._subgroups if not sg.kept)
    for sg in placement._subgroups[1:]:  # push the first group out of the store's slots
        placement.store.get(sg.id)
        placement.store.put(sg.id, dirty=False)
    before = placement.store._find(first) is not None
    model(**global_batch(1, BATCH, SEQ)).loss.backward()
    during = placement.store._find(first) is not None
    optimizer.step()
    slots = len(placement.store._slots)
    placement.close()
    return before, during, slots


@pytest.mark.timeout(60)
def test_backward_starts_reading_the_first_subgroup(tmp_path) -> None:
    before, during, slots = run_distributed(read_ahead_session, 1, str(tmp_path), timeout=45)[0]
    assert not before and during
    assert slots <= 3  # no slot is left held by a read nobody used
