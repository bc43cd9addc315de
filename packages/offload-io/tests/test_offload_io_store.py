"""State stores: the get/put/prefetch protocol, slots and double buffering, layout changes."""

from __future__ import annotations

import os

import pytest
import torch

from plait.offload_io import AsyncIOEngine, CpuStateStore, FileStateStore, GroupLayout, IOConfig
from plait.offload_io.file_store import BORROWED, READING, WRITING

FAST = IOConfig(block_size=64 << 10, queue_depth=4, workers=2, fsync=False)


def _group(seed: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n // 2 + seed, generator=g),
            "step": torch.tensor(float(seed))}


@pytest.fixture
def file_store(tmp_path):
    with AsyncIOEngine(FAST) as engine, FileStateStore(tmp_path, engine=engine, slots=3) as store:
        yield store


@pytest.fixture(params=["cpu", "file"])
def store(request, tmp_path):
    if request.param == "cpu":
        yield CpuStateStore()
        return
    with AsyncIOEngine(FAST) as engine, FileStateStore(tmp_path, engine=engine) as file_store:
        yield file_store


def test_register_get_put_round_trip_many_groups(store):
    groups = {gid: _group(gid) for gid in range(7)}
    for gid, tensors in groups.items():
        store.register(gid, tensors)
    assert list(store.group_ids()) == list(range(7))
    store.flush()
    for gid in reversed(range(7)):  # every group comes back, whichever slot it went through
        got = store.get(gid)
        assert set(got) == set(groups[gid])
        assert all(torch.equal(got[k], groups[gid][k]) for k in got)
        store.put(gid, dirty=False)


def test_in_place_updates_are_written_back(store):
    for gid in range(5):
        store.register(gid, _group(gid))
    for _ in range(3):
        for gid in range(5):
            if gid + 1 < 5:
                store.prefetch(gid + 1)
            tensors = store.get(gid)
            tensors["exp_avg"].add_(1.0)
            tensors["step"].add_(1)
            store.put(gid)
        store.flush()
    for gid in range(5):
        tensors = store.get(gid)
        assert torch.equal(tensors["exp_avg"], _group(gid)["exp_avg"].add(1.0).add(1.0).add(1.0))
        assert tensors["step"].item() == gid + 3
        store.put(gid, dirty=False)


def test_file_store_keeps_only_its_slots_in_memory(file_store):
    for gid in range(10):
        file_store.register(gid, _group(gid, n=50_000))
    file_store.flush()
    slot_bytes = GroupLayout.of(_group(9, n=50_000)).nbytes
    assert len(file_store._slots) == 3
    assert file_store.resident_bytes <= 3 * (slot_bytes + 4096) + file_store.engine.buffer_bytes
    assert all(os.path.getsize(file_store.file_of(g)) == file_store.layout(g).nbytes for g in range(10))


def test_double_buffering_reads_next_while_current_is_borrowed_and_previous_writes(file_store):
    for gid in range(4):
        file_store.register(gid, _group(gid, n=200_000))
    file_store.flush()
    for slot in file_store._slots:  # empty the cache so every get must read
        file_store._release(slot)
    file_store.prefetch(0)
    file_store.get(0)
    file_store.put(0)  # write-back of 0 starts
    file_store.prefetch(1)  # read of 1 starts
    file_store.get(1)
    file_store.prefetch(2)  # needs a third slot while 0 may still be writing
    states = {s.group_id: s.state for s in file_store._slots}
    assert states[1] == BORROWED
    assert states[2] in (READING, "resident")
    assert states.get(0) in (WRITING, "resident", None)
    file_store.put(1)
    file_store.get(2)
    file_store.put(2)
    file_store.flush()


def test_reregister_with_a_new_layout(store):
    store.register("g", _group(1))
    bigger = {**_group(2, n=3000), "extra": torch.arange(10)}
    store.register("g", bigger)
    got = store.get("g")
    assert set(got) == set(bigger) and torch.equal(got["extra"], torch.arange(10))
    store.put("g")
    store.flush()


def test_reregister_from_the_borrowed_views_themselves(store):
    # The optimizer's path when a parameter gets its first gradient: old state (viewing the slot)
    # plus a new entry are registered again; the slot may be reused for the new image.
    store.register("g", _group(1))
    got = store.get("g")
    got["exp_avg"].mul_(2.0)
    grown = {**got, "new": torch.full((5000,), 7.0)}
    store.put("g", dirty=False)
    store.register("g", grown)
    back = store.get("g")
    assert torch.equal(back["exp_avg"], _group(1)["exp_avg"].mul(2.0))
    assert torch.equal(back["exp_avg_sq"], _group(1)["exp_avg_sq"]) and torch.equal(back["new"], grown["new"])
    store.put("g")


def test_protocol_misuse_is_refused(file_store):
    file_store.register(0, _group(0))
    with pytest.raises(KeyError, match="never registered"):
        file_store.get(99)
    file_store.get(0)
    with pytest.raises(ValueError, match="already borrowed"):
        file_store.get(0)
    with pytest.raises(ValueError, match="borrowed"):
        file_store.register(0, _group(0))
    file_store.put(0)
    with pytest.raises(ValueError, match="without a matching get"):
        file_store.put(0)
    with pytest.raises(ValueError, match="stores hold CPU tensors"):
        file_store.register(1, {"x": torch.empty(2, device="meta")})
    with pytest.raises(ValueError, match="slots=1"):
        FileStateStore(file_store.directory, slots=1)


def test_damaged_group_file_is_refused_on_read(file_store):
    file_store.register(0, _group(0, n=100_000))
    file_store.register(1, _group(1, n=100_000))
    file_store.register(2, _group(2, n=100_000))
    file_store.register(3, _group(3, n=100_000))  # evicts group 0 from the slots
    file_store.flush()
    os.truncate(file_store.file_of(0), 100)
    with pytest.raises(OSError, match="holds only 100 bytes"):
        file_store.get(0)


def test_close_removes_the_files(tmp_path):
    store = FileStateStore(tmp_path / "state", engine=None)
    store.register(0, _group(0))
    store.flush()
    directory = store.directory
    assert os.listdir(directory)
    store.close()
    store.close()
    assert not os.path.exists(directory)
