"""R3 (corruption of every kind) and bad input: refused with a named file, source untouched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt import storage
from plait.universal_ckpt.manifest import _body_hash
from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig, small_model, train_steps


def save_two_ranks(root: str) -> None:
    model = small_model(0)
    engine = ToyZero(model, ToyZeroConfig(stage=3))
    train_steps(model, engine, range(1))
    uc.save({"zero": engine, "rng": uc.RNGState()}, root, step=1, layout=engine.layout(), chunk_bytes=4096)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    run_distributed(save_two_ranks, 2, str(root), timeout=90)
    return uc.latest(root)


def _copy(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def _target() -> tuple[dict, torch.Tensor]:
    model = small_model(9)
    engine = ToyZero(model, ToyZeroConfig(stage=3))
    return {"zero": engine, "rng": uc.RNGState()}, engine.master.clone()


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode() + file.read_bytes())
    return h.hexdigest()


def _refuse(ckpt: Path, error: type, *, verify: bool = True) -> Exception:
    state, before = _target()
    tree = _tree_digest(ckpt)
    with pytest.raises(error) as info:
        uc.load(state, ckpt, verify=verify)
    assert torch.equal(state["zero"].master, before), "a refused load touched the live state"
    assert _tree_digest(ckpt) == tree, "a refused load modified the checkpoint"
    return info.value


def test_pristine_loads(pristine, tmp_path):
    state, _ = _target()
    uc.load(state, _copy(pristine, tmp_path))
    uc.verify_checkpoint(pristine)


def test_bit_flip_names_file_and_hashes(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    path = ckpt / "data/rank-00001.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)
    err = _refuse(ckpt, uc.CheckpointIntegrityError)
    assert err.file == "data/rank-00001.bin" and err.expected in str(err) and err.actual in str(err)
    # A load checks the chunk's XXH3-64 checksum (16 hex digits); plait ckpt verify its sha256 (64).
    # (Without xxhash, which the package declares, saves write no checksums and loads check sha256.)
    fast = storage.xxhash is not None
    assert err.expected != err.actual and len(err.expected) == (16 if fast else 64)
    assert ("xxh3_64" if fast else "sha256") in str(err)
    with pytest.raises(uc.CheckpointIntegrityError, match="rank-00001.bin.*sha256") as full:
        uc.verify_checkpoint(ckpt)
    assert len(full.value.expected) == 64
    # The documented switch: verify=False skips hashing and loads the flipped bytes.
    state, _ = _target()
    uc.load(state, ckpt, verify=False)


def test_truncated_deleted_swapped(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    path = ckpt / "data/rank-00000.bin"
    os.truncate(path, path.stat().st_size - 3)
    err = _refuse(ckpt, uc.CheckpointIntegrityError, verify=False)
    assert err.file == "data/rank-00000.bin" and "bytes" in err.actual
    ckpt = _copy(pristine, tmp_path / "b")
    (ckpt / "data/rank-00001.bin").unlink()
    assert _refuse(ckpt, uc.CheckpointIntegrityError).file == "data/rank-00001.bin"
    ckpt = _copy(pristine, tmp_path / "c")
    a, b = ckpt / "data/rank-00000.bin", ckpt / "data/rank-00001.bin"
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
    assert _refuse(ckpt, uc.CheckpointIntegrityError).file in ("data/rank-00000.bin", "data/rank-00001.bin")
    ckpt = _copy(pristine, tmp_path / "d")
    obj = ckpt / "objects/rank-00000.json"
    data = bytearray(obj.read_bytes())
    data[-10] ^= 1
    obj.write_bytes(data)
    assert _refuse(ckpt, uc.CheckpointIntegrityError).file == "objects/rank-00000.json"


def _rewrite_manifest(ckpt: Path, edit) -> None:
    body = json.loads((ckpt / "manifest.json").read_text())
    body.pop("manifest_hash")
    edit(body)
    body["manifest_hash"] = _body_hash(body)
    (ckpt / "manifest.json").write_text(json.dumps(body))


def test_damaged_manifest(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    text = (ckpt / "manifest.json").read_text()
    (ckpt / "manifest.json").write_text(text.replace('"step": 1', '"step": 7'))
    assert "manifest_hash" in str(_refuse(ckpt, uc.CheckpointFormatError))
    (ckpt / "manifest.json").write_text(text[: len(text) // 2])
    assert "not valid JSON" in str(_refuse(ckpt, uc.CheckpointFormatError))


def test_manifest_and_files_disagree(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)

    def drop_piece(body: dict) -> None:
        entry = next(e for e in body["tensors"].values() if len(e["pieces"]) == 2)
        entry["pieces"].pop()

    _rewrite_manifest(ckpt, drop_piece)
    assert "cover" in str(_refuse(ckpt, uc.CheckpointFormatError))


def test_bad_input(pristine, tmp_path):
    with pytest.raises(uc.CheckpointNotFoundError):
        uc.load(_target()[0], tmp_path / "missing")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"x" * 10)
    with pytest.raises(uc.CheckpointNotFoundError, match="no committed plait checkpoint"):
        uc.load(_target()[0], foreign)
    (foreign / "manifest.json").write_text('{"hello": 1}')
    with pytest.raises(uc.CheckpointFormatError, match="not a plait"):
        uc.load(_target()[0], foreign)
    future = _copy(pristine, tmp_path / "future")
    _rewrite_manifest(future, lambda body: body.update(format_version=99))
    assert "upgrade" in str(_refuse(future, uc.CheckpointFormatError))


def test_target_cannot_hold_state(pristine, tmp_path):
    from plait.kernels.testing import tiny_llama

    ckpt = _copy(pristine, tmp_path)
    tree = _tree_digest(ckpt)
    wider = tiny_llama(vocab_size=300, hidden_size=48, num_layers=2, num_heads=2, intermediate_size=64,
                       max_seq_len=32)
    engine = ToyZero(wider, ToyZeroConfig(stage=3))
    before = engine.master.clone()
    with pytest.raises(uc.CheckpointLayoutError, match="embed_tokens.weight"):
        uc.load({"zero": engine}, ckpt)
    assert torch.equal(engine.master, before) and _tree_digest(ckpt) == tree
    with pytest.raises(uc.CheckpointLayoutError, match="'other' is not in the checkpoint"):
        uc.load({"zero": _target()[0]["zero"], "other": torch.zeros(3)}, ckpt)
    root = tmp_path / "root"
    shutil.copytree(pristine, root / pristine.name)
    with pytest.raises(uc.CheckpointExistsError):
        uc.save({"t": torch.zeros(3)}, root, step=1)
    assert _tree_digest(root / pristine.name) == tree


class _OwnCopy:
    """A producer whose every rank names itself the writer of a whole tensor ``w`` (as ZeRO does for
    a unit each rank holds whole), here with each rank's own values: not in fact a replica."""

    def __init__(self, rank: int) -> None:
        self.rank, self.w = rank, torch.full((4, 3), float(rank))

    def sharded_state_dict(self) -> dict:
        from plait.kernels.sharded_state import ShardedTensor, ShardSpec

        spec = ShardSpec.full("w", self.w, kind="parameter", replica_ranks=(self.rank,))
        return {"w": ShardedTensor(spec, self.w.reshape(-1))}

    def load_sharded_state_dict(self, state: dict) -> None:
        self.w.copy_(state["w"].local.view(4, 3))


def _save_diverged_replica(root: str) -> str:
    import torch.distributed as dist

    from plait.universal_ckpt.errors import CheckpointError

    try:
        uc.save({"model": _OwnCopy(dist.get_rank())}, root, step=1)
    except CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(90)
def test_replicas_with_different_values_are_refused_not_dropped(tmp_path):
    errors = run_distributed(_save_diverged_replica, 2, str(tmp_path / "root"), timeout=60)
    for error in errors:
        assert "ranks wrote different values for the same part" in error and "global identity" in error, errors
    assert not list((tmp_path / "root").glob("step-*")), "nothing may be committed"
