"""The TP=1 stream checked by a worker thread alongside the consumer's copies (no vLLM needed)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from plait.universal_ckpt import CheckpointIntegrityError, save
from plait.universal_ckpt.reader import read_manifest
from plait.vllm import checked_ahead
from plait.vllm.checked_ahead import AheadCheck
from plait.vllm.checkpoint_weights import CheckpointWeights
from plait.vllm.tensor_parallel import TensorParallelRank

CHUNK = 4096  # small checksum chunks: every weight spans several, so the two threads share tensors


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 80))


def _saved(tmp_path) -> tuple[nn.Module, object]:
    model = _model()
    save({"model": model}, tmp_path / "ckpt", step=1, chunk_bytes=CHUNK)
    return model, tmp_path / "ckpt" / "step-0000000001"


def save_zero(root: str, world: int) -> None:
    """One rank of a ToyZero stage-3 save: tensors straddling the rank boundary are split in two pieces."""
    from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig

    save({"model": ToyZero(_model(), ToyZeroConfig(stage=3))}, root, step=0, chunk_bytes=CHUNK)


def _flip(step, tensor_name: str) -> str:
    piece = read_manifest(step).tensors[tensor_name].pieces[0]
    raw = bytearray((step / piece.file).read_bytes())
    raw[piece.offset + piece.nbytes - 1] ^= 0x01  # in the tensor's last chunk
    (step / piece.file).write_bytes(bytes(raw))
    return piece.file


@pytest.mark.timeout(120)
def test_vllm_checked_ahead_streams_every_value_and_checks_every_byte(tmp_path):
    """Repeated loads (the two threads racing differently each time) copy every value exactly and
    count every byte of the checkpoint's tensors as checked; verify=False streams the same values."""
    model, step = _saved(tmp_path)
    expected = model.state_dict()
    pieces = [p for e in CheckpointWeights(step).entries() for p in e.pieces]
    for verify, worker in ((True, True), (True, False), (False, None)):
        for _ in range(20 if worker else 1):
            weights = CheckpointWeights(step, verify=verify)
            dest = {name: torch.zeros_like(t) for name, t in expected.items()}
            with weights.checked_ahead(worker=worker) as stream:
                for name, tensor in stream:
                    dest[name].copy_(tensor)
            for name, tensor in expected.items():
                torch.testing.assert_close(dest[name], tensor, rtol=0, atol=0)
            assert weights.checked_bytes == (sum(p.nbytes for p in pieces) if verify else None)
            assert weights.checked_ahead_worker is worker
            if verify:  # the worker claims each chunk at most once; without it the loading thread hashes all
                assert (0 <= weights.worker_checked_bytes <= weights.checked_bytes if worker
                        else weights.worker_checked_bytes == 0)


@pytest.mark.timeout(60)
def test_vllm_checked_ahead_consumer_checks_what_the_worker_has_not_started(tmp_path):
    """With no worker (no free core), the consumer's thread checks each tensor before handing it
    over: the damaged tensor is never handed over, and the error names the file and the tensor."""
    _, step = _saved(tmp_path)
    damaged = _flip(step, "model/2.weight")
    handed = []
    with pytest.raises(CheckpointIntegrityError) as info, CheckpointWeights(step).checked_ahead(worker=False) as stream:
        for name, _ in stream:
            handed.append(name)
    assert "2.weight" not in handed and "0.weight" in handed
    assert info.value.file == damaged and damaged in str(info.value) and "model/2.weight" in str(info.value)


@pytest.mark.timeout(60)
def test_vllm_checked_ahead_chunk_in_flight_is_checked_before_the_load_ends(tmp_path, monkeypatch):
    """A worker that claimed every chunk and never finished one (descheduled mid-hash): the consumer
    is handed the tensors without waiting for it, and leaving the block checks them itself and fails
    naming the file, so a load that copied a damaged value never returns."""
    _, step = _saved(tmp_path)
    damaged = _flip(step, "model/2.weight")
    claimed = threading.Event()

    def stalled(self: AheadCheck) -> None:
        with self._cond:
            self._next = len(self._chunks)
        claimed.set()

    monkeypatch.setattr(AheadCheck, "_work", stalled)
    handed = []
    with pytest.raises(CheckpointIntegrityError) as info, CheckpointWeights(step).checked_ahead(worker=True) as stream:
        assert claimed.wait(30)
        for name, _ in stream:
            handed.append(name)
    assert "2.weight" in handed  # handed over while in flight ...
    assert info.value.file == damaged and "model/2.weight" in str(info.value)  # ... and the load fails


@pytest.mark.timeout(60)
@pytest.mark.parametrize("consumer", ["all", "none"])
def test_vllm_checked_ahead_damage_fails_the_load_whoever_finds_it(tmp_path, consumer):
    """With the real worker (it or the consumer may find the damaged chunk), a consumer that reads
    every tensor, or none, leaves the block with the error naming the file."""
    _, step = _saved(tmp_path)
    damaged = _flip(step, "model/2.weight")
    with pytest.raises(CheckpointIntegrityError) as info, CheckpointWeights(step).checked_ahead(worker=True) as stream:
        if consumer == "all":
            for _, tensor in stream:
                torch.zeros_like(tensor).copy_(tensor)
    assert info.value.file == damaged and damaged in str(info.value)


@pytest.mark.timeout(60)
def test_vllm_checked_ahead_refuses_a_tensor_parallel_rank(tmp_path):
    _, step = _saved(tmp_path)
    weights = CheckpointWeights(step, tensor_parallel=TensorParallelRank(rank=0, size=2, num_key_value_heads=None))
    with pytest.raises(ValueError, match="checked_on_copy"), weights.checked_ahead():
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("cores", "load", "free"), [((0, 1), 1.5, True), ((0, 1), 2.0, False), ((0,), 0.0, False),
                                                     (tuple(range(16)), 12.0, True)])
def test_vllm_checked_ahead_worker_starts_only_with_a_free_core(tmp_path, monkeypatch, cores, load, free):
    """The default starts the worker only when this process may use two cores or more and the load
    average (which counts the loading process) is below their number."""
    monkeypatch.setattr(checked_ahead.os, "sched_getaffinity", lambda pid: set(cores))
    monkeypatch.setattr(checked_ahead.os, "getloadavg", lambda: (load, load, load))
    assert checked_ahead.core_free() is free
    _, step = _saved(tmp_path)
    weights = CheckpointWeights(step)
    with weights.checked_ahead() as stream:
        list(stream)
    assert weights.checked_ahead_worker is free


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker", [True, False])
def test_vllm_checked_ahead_reads_checkpoints_without_checksums(tmp_path, monkeypatch, worker):
    """A checkpoint saved without the fast checksums (before they existed, or without ``xxhash``) is
    checked against its sha256 chunk hashes: its values stream, and a flipped byte names the file."""
    from plait.universal_ckpt import storage

    monkeypatch.setattr(storage, "xxhash", None)  # the save writes sha256 hashes only
    model, step = _saved(tmp_path)
    assert all(p.checksums is None for e in read_manifest(step).tensors.values() for p in e.pieces)
    with CheckpointWeights(step).checked_ahead(worker=worker) as stream:
        got = {name: tensor.clone() for name, tensor in stream}
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    damaged = _flip(step, "model/0.weight")
    with pytest.raises(CheckpointIntegrityError) as info, CheckpointWeights(step).checked_ahead(worker=worker) as s:
        list(s)
    assert info.value.file == damaged and "sha256" in str(info.value)


@pytest.mark.timeout(180)
def test_vllm_checked_ahead_zero_save_consolidates_split_tensors(tmp_path):
    """A ZeRO W=2 save (some tensors in two pieces, consolidated and checked as they are read; the
    others mapped and checked by the worker or first): the values stream exactly, with and without the worker, and a
    flipped byte in a split tensor fails naming its file."""
    from plait.kernels.testing import run_distributed

    root = tmp_path / "ckpt"
    run_distributed(save_zero, 2, str(root), 2, timeout=120)
    step = root / "step-0000000000"
    entries = [e for e in read_manifest(step).tensors.values() if e.key == "model" and e.kind == "parameter"]
    split = [e for e in entries if len(e.pieces) > 1]
    assert split and len(split) < len(entries), "the save should split some tensors and keep others whole"
    expected = _model().state_dict()
    for worker in (True, False):
        with CheckpointWeights(root).checked_ahead(worker=worker) as stream:
            got = {name: tensor.clone() for name, tensor in stream}
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    piece = split[0].pieces[0]
    raw = bytearray((step / piece.file).read_bytes())
    raw[piece.offset] ^= 0x01
    (step / piece.file).write_bytes(bytes(raw))
    with pytest.raises(CheckpointIntegrityError) as info, CheckpointWeights(root).checked_ahead(worker=True) as s:
        list(s)
    assert info.value.file == piece.file and piece.file in str(info.value)


@pytest.mark.timeout(60)
def test_vllm_checked_ahead_damage_the_worker_found_stops_the_stream(tmp_path, monkeypatch):
    """Once the worker has found a damaged chunk, the stream hands over no further tensor: here the
    worker checks every chunk before the consumer asks for the first one, so it gets none."""
    _, step = _saved(tmp_path)
    damaged = _flip(step, "model/2.weight")
    started = AheadCheck.__init__

    def worker_first(self: AheadCheck, *args, **kwargs) -> None:
        started(self, *args, **kwargs)
        self._worker.join()  # the worker claims every chunk, then ends

    monkeypatch.setattr(AheadCheck, "__init__", worker_first)
    handed = []
    with pytest.raises(CheckpointIntegrityError) as info, CheckpointWeights(step).checked_ahead(worker=True) as stream:
        for name, _ in stream:
            handed.append(name)
    assert handed == [] and info.value.file == damaged and "model/2.weight" in str(info.value)
