"""ZeRO-Infinity: stage-3 parameter shards on CPU/NVMe, bitwise equal to in-memory ZeRO-3.

One session per world size trains tiny-llama with plain ZeRO-3 and with parameters offloaded
(``param_device`` "cpu" with state in CPU memory, "nvme" with state and fp32 masters on NVMe,
and bf16 compute with everything on NVMe); losses, parameters and optimizer state must match
bit for bit. Between steps every sharded unit's shard must hold zero bytes of memory, edits
made under ``gathered_parameters(writeback=True)`` must reach the files, and a checkpoint
round trip (``state_dict``/``load_state_dict`` into a fresh offloaded run) must resume exactly.
A rank that cannot write its shards (``RLIMIT_FSIZE``) makes every rank raise, keeps the
shards in memory, and the next step writes them: training then matches the reference.
"""

from __future__ import annotations

import copy
import os
import resource
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper beside this file

from zero_full_state import full_optimizer_state

from plait.kernels.testing import global_batch, rank_slice, run_distributed, tiny_llama, train_losses

MODEL = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300)
BATCH, SEQ, STEPS = 4, 32, 3
# fused=True on both sides: the placement makes AdamW fused unless told otherwise (the fastest CPU
# kernel), and fused differs from the foreach default in the last bits.
OPT = dict(lr=1e-3, weight_decay=0.1, fused=True)
VARIANTS = [("cpu", "cpu", torch.float32), ("nvme", "nvme", torch.float32), ("nvme", "nvme", torch.bfloat16),
            ("nvme", "cpu", torch.float32)]


def _offload(root: str, device: str, param_device: str, *, prefix: str = "", **settings):
    """The tests' offload settings: small I/O blocks, no fsync, one directory per rank; ``settings``
    override OffloadConfig fields (``sub_group_size`` defaults to 8192)."""
    from plait.offload_io import IOConfig, OffloadConfig

    io = IOConfig(block_size=65536, queue_depth=4, workers=2, fsync=False, min_free_bytes=0)
    path = os.path.join(root, f"{prefix}rank{torch.distributed.get_rank()}")
    return OffloadConfig(device=device, path=path, param_device=param_device, io=io,
                         **{"sub_group_size": 8192, **settings})


def _build(placement=None, dtype: torch.dtype = torch.float32):
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    config = ZeroConfig(stage=3, compute_dtype=dtype, param_persistence_threshold=256)
    return zero_shard(tiny_llama(**MODEL), torch.optim.AdamW, config, placement=placement, **OPT)


def _train(model, optimizer, steps: int, start: int = 0) -> list[float]:
    return train_losses(model, optimizer, steps, batch=BATCH, seq=SEQ, start=start)


def _params(model) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _shards_out(model) -> tuple[int, int]:
    """(sharded units with a storage, those holding any shard memory now)."""
    units = [u for u in model.zero_engine.units if u.storage is not None]
    return len(units), sum(u.shard_loaded or u.shard.untyped_storage().nbytes() > u.shard.element_size()
                           for u in units)


def infinity_session(root: str) -> dict:
    from plait.offload_io import zero_placement

    out: dict = {}
    references = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, optimizer = _build(dtype=dtype)
        losses = _train(model, optimizer, STEPS)
        references[dtype] = (losses, _params(model), full_optimizer_state(model),
                             _train(model, optimizer, 1, STEPS), _params(model))
    for param_device, device, dtype in VARIANTS:
        name = f"{param_device}-{device}-{str(dtype)[6:]}"
        ref_losses, ref_params, ref_state, ref_next, ref_next_params = references[dtype]
        placement = zero_placement(_offload(root, device, param_device))
        model, optimizer = _build(placement, dtype)
        losses = _train(model, optimizer, STEPS)
        attached, loaded = _shards_out(model)
        checks = {"losses": losses == ref_losses, "params": _equal(_params(model), ref_params),
                  "attached": attached, "loaded_between_steps": loaded}
        state = optimizer.state_dict()
        checks["state"] = _equal(full_optimizer_state(model), ref_state)
        if param_device == "nvme":
            storage = placement.shard_storage()
            checks["files"] = len(os.listdir(storage.directory))
        # Resume: this run's optimizer state and masters into a fresh offloaded run, one more step.
        fresh_placement = zero_placement(_offload(root, device, param_device))
        fresh, fresh_opt = _build(fresh_placement, dtype)
        fresh.load_state_dict(model.state_dict())
        fresh_opt.load_state_dict(copy.deepcopy(state))
        checks["resume"] = _train(fresh, fresh_opt, 1, STEPS) == ref_next and _equal(_params(fresh), ref_next_params)
        fresh_placement.close()
        # Edits under gathered_parameters(writeback=True) go to masters and offloaded shards.
        with model.gathered_parameters(writeback=True):
            model.norm.weight.data.fill_(0.5)
            model.lm_head.weight.data[0].fill_(0.25)
        after = _params(model)
        checks["writeback"] = bool((after["norm.weight"] == 0.5).all() and
                                   (after["lm_head.weight"][0] == 0.25).all())
        checks["loaded_after_writeback"] = _shards_out(model)[1]
        placement.close()
        out[name] = checks
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_parameters_train_bitwise_like_zero3(world: int, tmp_path) -> None:
    results = run_distributed(infinity_session, world, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        for name, checks in result.items():
            assert checks["losses"] and checks["params"] and checks["state"], (rank, name, checks)
            assert checks["attached"] >= 3 and checks["loaded_between_steps"] == 0, (rank, name, checks)
            assert checks["resume"] and checks["writeback"], (rank, name, checks)
            assert checks["loaded_after_writeback"] == 0, (rank, name, checks)
            if name.startswith("nvme"):
                assert checks["files"] == checks["attached"], (rank, name, checks)
    assert not any(os.scandir(tmp_path / "rank0")), "closing the placement removes its files"


def shard_disk_full_session(root: str) -> dict:
    """Rank 1 cannot write its parameter shards for one step: every rank raises, nothing is lost."""
    from plait.offload_io import OffloadDiskFullError, zero_placement

    model_ref, opt_ref = _build()
    reference = _train(model_ref, opt_ref, 2), _params(model_ref)
    placement = zero_placement(_offload(root, "cpu", "nvme"))
    model, optimizer = _build(placement)
    rank = torch.distributed.get_rank()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() returns EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    error = "no error"
    loss = model(**rank_slice(global_batch(0, BATCH, SEQ), rank, torch.distributed.get_world_size())).loss
    loss.backward()
    losses = [loss.item()]
    try:
        optimizer.step()
    except OffloadDiskFullError as exc:
        error = type(exc).__name__
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    optimizer.zero_grad()
    held = _shards_out(model)[1]
    losses += _train(model, optimizer, 1, 1)
    placement.close()
    return {"error": error, "held": held, "same": losses == reference[0] and _equal(_params(model), reference[1])}


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE/SIGXFSZ semantics are Linux's")
def test_shard_write_failure_raises_everywhere_and_loses_nothing(tmp_path) -> None:
    # The limit is set after the shards' first write, so only the step's write-back fails.
    results = run_distributed(shard_disk_full_session, 2, str(tmp_path), timeout=90)
    assert [r["error"] for r in results] == ["OffloadDiskFullError"] * 2, results
    assert results[1]["held"] > 0 and results[0]["held"] == 0, results
    assert all(r["same"] for r in results), results


def refuse_stage2_session(root: str) -> str:
    from plait.offload_io import zero_placement
    from plait.zero_sharding import ZeroConfig, zero_shard

    with pytest.raises(ValueError, match="param_device") as info:
        zero_shard(tiny_llama(**MODEL), torch.optim.AdamW, ZeroConfig(stage=2),
                   placement=zero_placement(_offload(root, "cpu", "nvme")))
    return str(info.value)


@pytest.mark.timeout(60)
def test_parameter_offload_needs_stage_3(tmp_path) -> None:
    message = run_distributed(refuse_stage2_session, 1, str(tmp_path), timeout=45)[0]
    assert "stage=3" in message and "stage=2" in message


def split_master_session(root: str) -> dict:
    """Units (the embedding, the head) several times ``sub_group_size``: their masters are stepped
    in pieces, and the store's slots are bounded by the setting, not by those units."""
    from plait.offload_io import zero_placement
    from plait.offload_io.subgroups import MasterPiece

    sub_group = 4096
    model, optimizer = _build()
    ref_losses, ref_params = _train(model, optimizer, STEPS), _params(model)
    ref_state = full_optimizer_state(model)
    placement = zero_placement(_offload(root, "nvme", "nvme", sub_group_size=sub_group))
    model, optimizer = _build(placement)
    losses = _train(model, optimizer, STEPS)
    store = placement.store
    largest_master = max(m.numel() for m in placement._masters.values())
    largest_group = max(store.layout(gid).nbytes for gid in store.group_ids())
    slot_bytes = sum(s.buffer.numel() for s in store._slots)
    out = {"losses": losses == ref_losses, "params": _equal(_params(model), ref_params),
           "state": _equal(full_optimizer_state(model), ref_state),
           "pieces": sum(isinstance(sg, MasterPiece) for sg in placement._subgroups),
           "largest_master": largest_master, "largest_group": largest_group, "slot_bytes": slot_bytes,
           "slots": len(store._slots), "alignment": placement.config.io.alignment, "sub_group": sub_group}
    placement.close()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_split_masters_step_bitwise_and_bound_the_slots(world: int, tmp_path) -> None:
    for rank, r in enumerate(run_distributed(split_master_session, world, str(tmp_path), timeout=150)):
        assert r["largest_master"] > 2 * r["sub_group"] and r["pieces"] >= 3, (rank, r)
        assert r["losses"] and r["params"] and r["state"], (rank, r)
        # A group holds at most sub_group elements of master + two moments (12 bytes each), each
        # tensor padded to the alignment, plus the step counters (one aligned block each).
        bound = r["sub_group"] * 12 + 8 * r["alignment"]
        assert r["largest_group"] <= bound < r["largest_master"] * 12, (rank, r)
        assert r["slots"] == 3 and r["slot_bytes"] <= 3 * bound, (rank, r)


def _accumulate_and_clip(model, optimizer, steps: int) -> list[float]:
    """Two micro-batches per step (the second under ``no_sync`` is not used: both reduce, so the
    stored sum is read back and added), then clipping through ``clip_grad_norm_``."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in range(steps):
        for micro in range(2):
            loss = model(**rank_slice(global_batch(10 * step + micro, BATCH, SEQ), rank, world)).loss
            loss.backward()
            losses.append(loss.item())
        losses.append(float(optimizer.clip_grad_norm_(0.05)))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def grad_offload_session(root: str) -> dict:
    """Reduced gradient shards in files (``grad_device="nvme"``): bitwise ZeRO-2/3 in memory,
    with accumulation over micro-batches and clipping, and no gradient left in memory. At stage 3
    the in-memory reference uses ZeRO-Infinity's unit layout (the embedding and the head units of
    their own): the clipping norm sums per-unit squares, so another grouping differs in the last
    bits (plain training is compared with the default layout in ``infinity_session``)."""
    from plait.offload_io import zero_placement
    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding.extension import LocalPlacement

    class SameUnits(LocalPlacement):
        offloads_parameters = True  # in memory, with the units of offloaded parameters

    out: dict = {}
    for stage in (2, 3):
        def build(placement=None, stage=stage):
            torch.manual_seed(0)
            config = ZeroConfig(stage=stage, param_persistence_threshold=256)
            return zero_shard(tiny_llama(**MODEL), torch.optim.AdamW, config, placement=placement, **OPT)

        model, optimizer = build(SameUnits() if stage == 3 else None)
        ref = (_train(model, optimizer, STEPS), _accumulate_and_clip(model, optimizer, 2), _params(model))
        placement = zero_placement(_offload(root, "nvme", "nvme" if stage == 3 else "none", prefix=f"s{stage}-",
                                            sub_group_size=4096, grad_device="nvme"))
        model, optimizer = build(placement)
        engine = model.zero_engine
        losses = _train(model, optimizer, STEPS)
        loss = model(**rank_slice(global_batch(99, BATCH, SEQ), torch.distributed.get_rank(),
                                  torch.distributed.get_world_size())).loss
        loss.backward()
        engine.finish_gradients()
        held = sum(u.grad_shard is not None for u in engine.units)
        stored = len(engine.grad_stash.stored)
        optimizer.zero_grad()
        ours = (losses, _accumulate_and_clip(model, optimizer, 2), _params(model))
        out[stage] = {"plain": ours[0] == ref[0], "accumulated": ours[1] == ref[1], "params": _equal(ours[2], ref[2]),
                      "held_after_backward": held, "stored": stored, "units": len(engine.units),
                      "files": len(os.listdir(placement.grad_storage().directory))}
        placement.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2])
def test_gradient_offload_is_bitwise_and_frees_gradients(world: int, tmp_path) -> None:
    for rank, result in enumerate(run_distributed(grad_offload_session, world, str(tmp_path), timeout=200)):
        for stage, r in result.items():
            assert r["plain"] and r["accumulated"] and r["params"], (rank, stage, r)
            assert r["held_after_backward"] == 0 and r["stored"] == r["units"] == r["files"], (rank, stage, r)


def _refuse_grad_offload() -> str:
    from plait.offload_io import OffloadConfig

    try:
        OffloadConfig(device="cpu", grad_device="nvme")
    except ValueError as exc:
        return str(exc)
    return ""


def test_gradient_offload_needs_nvme_state() -> None:
    assert "grad_device='nvme' needs device='nvme'" in _refuse_grad_offload()
