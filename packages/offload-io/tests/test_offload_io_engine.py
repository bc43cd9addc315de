"""The async I/O engine: round trips of odd sizes, dtypes and offsets, O_DIRECT and its fallback."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from plait.offload_io import AsyncIOEngine, IOConfig, OffloadCorruptFileError, OffloadIOError, aligned_empty
from plait.offload_io import probe as probe_mod

SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3]
OFFSETS = [0, 3, 4096, 8192 + 5]
SMALL = IOConfig(block_size=64 << 10, queue_depth=4, workers=2)


@pytest.fixture
def engine():
    with AsyncIOEngine(SMALL) as eng:
        yield eng


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_round_trip_odd_sizes_and_offsets(engine, tmp_path, nbytes, offset):
    data = _random_bytes(nbytes, seed=nbytes + offset)
    path = tmp_path / "x.bin"
    engine.write(data, path, offset).wait()
    assert os.path.getsize(path) == offset + nbytes
    back = torch.zeros_like(data)
    engine.read_into(back, path, offset).wait()
    assert torch.equal(back, data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64, torch.float64])
def test_round_trip_dtypes_and_shapes(engine, tmp_path, dtype):
    source = torch.randn(37, 129, dtype=torch.float64)
    tensor = (source > 0) if dtype == torch.bool else source.to(dtype)
    engine.write(tensor, tmp_path / "t.bin", 4096).wait()
    back = torch.empty_like(tensor)
    engine.read_into(back, tmp_path / "t.bin", 4096).wait()
    assert torch.equal(back, tensor)


def test_aligned_and_unaligned_sources_give_the_same_file(engine, tmp_path):
    data = _random_bytes(3 * 65536 + 17, seed=1)
    aligned = aligned_empty(data.numel())
    aligned.copy_(data)
    unaligned = torch.empty(data.numel() + 1, dtype=torch.uint8)[1:]
    unaligned.copy_(data)
    assert aligned.data_ptr() % 4096 == 0 and unaligned.data_ptr() % 4096 != 0
    engine.write(aligned, tmp_path / "a.bin").wait()
    engine.write(unaligned, tmp_path / "u.bin").wait()
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "u.bin").read_bytes() == bytes(data.numpy())


def test_many_writes_at_offsets_of_one_file_in_flight(engine, tmp_path):
    pieces = [_random_bytes(5000 + i * 333, seed=i) for i in range(8)]
    offsets, position = [], 0
    for piece in pieces:
        offsets.append(position)
        position += piece.numel()
    handles = [engine.write(p, tmp_path / "f.bin", o) for p, o in zip(pieces, offsets)]
    engine.wait()
    assert all(h.done() for h in handles)
    reads = [torch.empty_like(p) for p in pieces]
    for r, o in zip(reads, offsets):
        engine.read_into(r, tmp_path / "f.bin", o)
    engine.wait()
    assert all(torch.equal(a, b) for a, b in zip(reads, pieces))


def test_write_never_truncates(engine, tmp_path):
    path = tmp_path / "keep.bin"
    engine.write(_random_bytes(10000), path).wait()
    engine.write(torch.zeros(10, dtype=torch.uint8), path).wait()
    assert os.path.getsize(path) == 10000


def test_empty_tensor(engine, tmp_path):
    engine.write(torch.empty(0), tmp_path / "e.bin").wait()
    engine.read_into(torch.empty(0), tmp_path / "e.bin").wait()


def test_o_direct_probe_on_this_filesystem(tmp_path):
    # Not asserting a value (it depends on the filesystem), only that the probe answers and cleans up.
    assert probe_mod.o_direct_supported(str(tmp_path), 4096) in (True, False)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".plait-odirect-")]


def test_falls_back_to_buffered_io_when_o_direct_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_mod, "o_direct_supported", lambda directory, alignment: False)
    data = _random_bytes((1 << 20) + 3, seed=7)
    with AsyncIOEngine(SMALL) as eng:
        handle = eng.write(data, tmp_path / "b.bin")
        handle.wait()
        back = torch.empty_like(data)
        eng.read_into(back, tmp_path / "b.bin").wait()
    assert torch.equal(back, data)


def test_o_direct_on_where_refused_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_mod, "o_direct_supported", lambda directory, alignment: False)
    config = IOConfig(block_size=65536, queue_depth=2, workers=1, use_o_direct="on")
    with AsyncIOEngine(config) as eng, pytest.raises(OffloadIOError, match="use_o_direct='auto'") as info:
        eng.write(torch.ones(4096, dtype=torch.uint8), tmp_path / "d.bin")
    assert info.value.errno == errno.EINVAL


def test_einval_from_a_direct_request_is_redone_buffered(tmp_path, monkeypatch):
    real_pwrite = os.pwrite
    refused = []

    def picky_pwrite(fd, data, offset):
        if os.get_blocking(fd) and fcntl_flags(fd) & probe_mod.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "refused")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", picky_pwrite)
    data = _random_bytes(3 * 65536, seed=3)
    with AsyncIOEngine(SMALL) as eng:
        eng.write(data, tmp_path / "r.bin").wait()
    assert (tmp_path / "r.bin").read_bytes() == bytes(data.numpy())
    if probe_mod.o_direct_supported(str(tmp_path), 4096):
        assert refused


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_read_of_short_or_missing_file_is_refused_up_front(engine, tmp_path):
    engine.write(_random_bytes(100), tmp_path / "short.bin").wait()
    with pytest.raises(OffloadCorruptFileError, match="holds only 100 bytes"):
        engine.read_into(torch.empty(200, dtype=torch.uint8), tmp_path / "short.bin")
    with pytest.raises(OffloadCorruptFileError, match="does not exist"):
        engine.read_into(torch.empty(1, dtype=torch.uint8), tmp_path / "missing.bin")


def test_bad_inputs(engine, tmp_path):
    with pytest.raises(ValueError, match="non-contiguous"):
        engine.write(torch.randn(8, 8).t(), tmp_path / "n.bin")
    with pytest.raises(ValueError, match="offset=-1"):
        engine.write(torch.randn(8), tmp_path / "n.bin", -1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        engine.write(b"bytes", tmp_path / "n.bin")
    with pytest.raises(OffloadIOError, match="No such file or directory"):
        engine.write(torch.randn(8), tmp_path / "no" / "such" / "dir.bin")


def test_closed_engine_refuses_work(tmp_path):
    eng = AsyncIOEngine(SMALL)
    eng.close()
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.write(torch.randn(4), tmp_path / "c.bin")


def test_write_overlaps_with_the_caller(tmp_path):
    # The call returns before the bytes are on disk: the caller's thread is free to compute.
    data = _random_bytes(32 << 20, seed=5)
    with AsyncIOEngine(IOConfig(block_size=1 << 20, queue_depth=2, workers=1)) as eng:
        handle = eng.write(data, tmp_path / "o.bin")
        returned_early = not handle.done()
        checksum = int(data[: 1 << 20].sum())  # compute while the write runs
        handle.wait()
    assert returned_early and checksum >= 0


def test_io_leaves_a_tensor_storage_resizable(engine, tmp_path):
    """plait-zero-sharding reads shards straight into gathered buffers and frees them by resizing
    their storage to zero: the engine's zero-copy path must not pin the storage's size (numpy
    sharing would)."""
    path = str(tmp_path / "r.bin")
    for source in (aligned_empty(8192, dtype=torch.float32), torch.arange(3000, dtype=torch.float32)):
        source.copy_(torch.arange(source.numel(), dtype=torch.float32))
        engine.write(source, path).wait()
        back = torch.empty(source.numel())
        engine.read_into(back, path).wait()
        assert torch.equal(back, source)
        for tensor in (source, back):
            tensor.untyped_storage().resize_(0)  # raises "not resizable" if the engine pinned it
            assert tensor.untyped_storage().nbytes() == 0


def test_a_finished_operation_does_not_pin_its_tensor(engine, tmp_path):
    """Once a write or read is done, the engine keeps no reference to the tensor's memory (its
    dispatcher held the last operation until the next one came, which kept a whole written shard
    alive after ZeRO-Infinity had freed it)."""
    import gc

    for kind in ("write", "read"):
        tensor = torch.arange(1 << 16, dtype=torch.float32)
        path = str(tmp_path / "pin.bin")
        handle = engine.write(tensor, path) if kind == "write" else engine.read_into(tensor, path)
        handle.wait()
        address = tensor.data_ptr()
        del tensor, handle
        gc.collect()
        alive = [t for t in gc.get_objects() if _storage_address(t) == address]
        assert alive == [], kind


def _storage_address(obj) -> int | None:
    """The data address of a real CPU tensor's storage, or None for anything else (fake and
    functional tensors that earlier tests of the same process left behind have no address)."""
    if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" or obj.is_meta:
        return None
    try:
        return obj.untyped_storage().data_ptr()
    except RuntimeError:
        return None
