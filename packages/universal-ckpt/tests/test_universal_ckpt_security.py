"""Checkpoints that cannot run code: crafted pickles, escaping paths, pruning a foreign directory.

Every attack writes a marker file if any code of the attacker's runs; the marker must never
appear. The attacks are listed in ``ATTACKS`` and written into the security results file by
``security_report.py`` (same scenarios, same code).
"""

from __future__ import annotations

import argparse
import base64
import enum
import hashlib
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import plait.universal_ckpt as uc
from plait.universal_ckpt import cli
from plait.universal_ckpt.interop import dcp as dcp_interop
from plait.universal_ckpt.interop import deepspeed as ds_interop
from plait.universal_ckpt.manifest import _body_hash


class _Marker:
    """Pickles to ``os.system('touch <marker>')``: if it is ever unpickled, the marker appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Color(enum.Enum):
    RED = 1


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])
    return {"model": model, "opt": opt, "sched": sched, "rng": uc.RNGState(),
            "scaler": torch.amp.GradScaler("cpu", init_scale=128.0)}


def _resign(ckpt: Path, edit) -> None:
    """Edit the manifest and recompute its hash, as an attacker can."""
    path = ckpt / "manifest.json"
    body = json.loads(path.read_text())
    body.pop("manifest_hash")
    edit(body)
    body["manifest_hash"] = _body_hash(body)
    path.write_text(json.dumps(body))


def _plant_objects(ckpt: Path, payload: object) -> None:
    """Replace rank 0's object file with a pickle of ``payload`` (the older format) and re-sign
    the manifest to match, as an attacker can."""
    for old in (ckpt / "objects").iterdir():
        old.unlink()
    data_path = ckpt / "objects/rank-00000.pt"
    torch.save(payload, data_path)
    data = data_path.read_bytes()

    def edit(body: dict) -> None:
        body["objects"]["0"].update(file="objects/rank-00000.pt", nbytes=len(data),
                                    hash=hashlib.sha256(data).hexdigest(), encoding="pickle")

    _resign(ckpt, edit)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    uc.save(_state(), tmp_path / "root", step=1)
    return uc.latest(tmp_path / "root")


def test_allowlisted_state_round_trips(tmp_path):
    uc.register_safe_types(Color)
    state = _state(0)
    np.random.seed(3)
    random.seed(4)
    extra = {"hparams": argparse.Namespace(lr=0.1, dims=(4, 3)), "color": Color.RED, "inf": float("inf"),
             "np": np.arange(3, dtype=np.float32), "np_scalar": np.int64(7), "dtype": torch.bfloat16,
             "size": torch.Size([2, 3]), "keys": {1: "a", (2, 3): b"x"}}
    uc.save({**state, "extra": extra}, tmp_path / "r", step=1)
    expected_np, expected_py = np.random.rand(), random.random()
    target = {**_state(1), "extra": None}
    uc.load(target, tmp_path / "r")
    target_extra = target["extra"]  # a plain value is replaced in the state dict
    assert torch.equal(target["model"].weight, state["model"].weight)
    assert target["sched"].state_dict()["_milestones"] == [2]
    assert target["scaler"].get_scale() == 128.0
    assert (np.random.rand(), random.random()) == (expected_np, expected_py)
    assert target_extra["hparams"] == extra["hparams"] and target_extra["color"] is Color.RED
    assert target_extra["keys"] == extra["keys"] and target_extra["np"].tolist() == [0.0, 1.0, 2.0]


def test_unsafe_value_refused_at_save_naming_the_key_path(tmp_path):
    with pytest.raises(uc.UnsafeObjectError) as info:
        uc.save({"model": nn.Linear(2, 2), "extra": {"cfg": {"fn": [print]}}}, tmp_path / "r", step=1)
    assert info.value.key_path == "['extra']['cfg']['fn'][0]" and "builtin_function_or_method" in str(info.value)
    assert "allow_pickle=True" in str(info.value)
    assert not (tmp_path / "r" / "step-0000000001").exists()


def test_allow_pickle_needs_trust_on_load(tmp_path):
    uc.save({"extra": {"when": _Opaque(5)}}, tmp_path / "r", step=1, allow_pickle=True)
    assert uc.read_manifest(uc.latest(tmp_path / "r")).pickled_objects
    with pytest.raises(uc.UnsafeObjectError, match="trust_pickled_objects=True"):
        uc.load({"extra": {}}, tmp_path / "r")
    state: dict = {"extra": None}
    uc.load(state, tmp_path / "r", trust_pickled_objects=True)
    assert state["extra"]["when"].value == 5


class _Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


def _inspect(path: Path) -> int:
    return cli.run_inspect(argparse.Namespace(path=str(path), limit=0, hash=True))


def test_crafted_objects_never_run(ckpt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    _plant_objects(ckpt, {"sched": _Marker(marker)})
    assert cli.run_verify(argparse.Namespace(path=str(ckpt))) == 0  # hashes match: verify only hashes bytes
    assert _inspect(ckpt) == 0
    with pytest.raises(uc.UnsafeObjectError, match="posix.system|os.system") as info:
        uc.load(_state(1), ckpt)
    assert info.value.key_path == "objects/rank-00000.pt"
    assert not marker.exists()


def test_json_objects_run_no_unpickler(ckpt, tmp_path, monkeypatch):
    # the fixture's state (optimizer, SequentialLR over LambdaLR, GradScaler, RNG) is all plain: JSON
    record = uc.read_manifest(ckpt).objects[0]
    assert (record.encoding, record.file) == ("json", "objects/rank-00000.json")

    def no_unpickler(*args, **kwargs):
        raise AssertionError("an unpickler ran")

    with monkeypatch.context() as patch:
        for owner, name in ((torch, "load"), (pickle, "loads"), (pickle, "Unpickler")):
            patch.setattr(owner, name, no_unpickler)
        uc.load(_state(1), ckpt)
    # a forger's JSON: pickle bytes under an unknown kind, and a tensor declaring 2**40 elements
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps(_Marker(marker))).decode()
    for value, match in (({"$plait": "pickle", "base64": payload}, "unknown kind 'pickle'"),
                         ({"$plait": "tensor", "dtype": "float32", "shape": [1 << 40], "base64": ""},
                          "data bytes for shape")):
        data = json.dumps({"format": "plait-objects", "version": 1, "objects": {"sched": value}}).encode()
        (ckpt / record.file).write_bytes(data)
        fields = {"nbytes": len(data), "hash": hashlib.sha256(data).hexdigest()}
        _resign(ckpt, lambda body, fields=fields: body["objects"]["0"].update(fields))
        with pytest.raises(uc.CheckpointFormatError, match=match) as info:
            uc.load(_state(1), ckpt)
        assert "objects/rank-00000.json" in str(info.value) and "['sched']" in str(info.value)
    assert not marker.exists()


def test_old_format_objects_still_load(ckpt):
    # today's format is yesterday's: a torch.save'd dict of plain values; the restricted reader takes it
    sched = _state(0)["sched"]
    sched.step()
    _plant_objects(ckpt, {"sched": sched.state_dict(), "rng": uc.RNGState().state_dict(),
                          "opt": {"param_groups": [{"lr": 0.5, "params": [0, 1]}], "scalars": {}},
                          "scaler": torch.amp.GradScaler("cpu").state_dict()})
    target = _state(1)
    del target["opt"]  # the planted param groups do not match the fixture's optimizer tensors
    uc.load(target, ckpt, strict=False)
    assert target["sched"].last_epoch == 1


def _crafted_deepspeed(tmp_path: Path, marker: Path) -> Path:
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    torch.save({"module": {"w": torch.ones(2)}, "args": _Marker(marker)}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return tmp_path / "ds"


def test_crafted_deepspeed_pickle_refused(tmp_path):
    marker = tmp_path / "pwned"
    src = _crafted_deepspeed(tmp_path, marker)
    with pytest.raises(uc.UnsafeObjectError, match=r"posix\.system|os\.system") as info:
        ds_interop._load(src / "global_step1" / "mp_rank_00_model_states.pt")
    assert "mp_rank_00_model_states.pt" in str(info.value)
    assert not marker.exists()


def test_crafted_dcp_metadata_refused(tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "dcp"
    src.mkdir()
    import pickle

    (src / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(uc.UnsafeObjectError, match=r"posix\.system|os\.system"):
        dcp_interop.import_dcp(src, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["../outside.bin", "/etc/passwd", "data/../../x", "data\\..\\x"])
def test_traversal_paths_refused_naming_the_field(ckpt, bad):
    def edit(body: dict) -> None:
        entry = next(iter(body["tensors"].values()))
        old = entry["pieces"][0]["file"]
        entry["pieces"][0]["file"] = bad
        body["files"][bad] = body["files"].pop(old)

    _resign(ckpt, edit)
    with pytest.raises(uc.PathEscapeError) as info:
        uc.load(_state(1), ckpt)
    assert "files[" in info.value.field or "pieces[0].file" in info.value.field


def test_symlink_escape_refused(ckpt, tmp_path):
    outside = tmp_path / "secret.bin"
    data = ckpt / "data" / "rank-00000.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    with pytest.raises(uc.PathEscapeError, match="outside the checkpoint"):
        uc.load(_state(1), ckpt)
    with pytest.raises(uc.PathEscapeError):
        uc.verify_checkpoint(ckpt)


def test_keep_last_never_deletes_foreign_directories(tmp_path):
    root = tmp_path / "root"
    user = root / "step-0000000000"  # named like a checkpoint, but a user's directory
    user.mkdir(parents=True)
    (user / "manifest.json").write_text('{"mine": true}')
    elsewhere = tmp_path / "precious"
    uc.save(_state(), tmp_path / "other", step=3)
    os.rename(uc.latest(tmp_path / "other"), elsewhere)  # a real plait checkpoint outside the root
    (root / "step-0000000002").symlink_to(elsewhere)
    for step in (5, 6, 7):
        uc.save(_state(), root, step=step, keep_last=1)
    assert (user / "manifest.json").read_text() == '{"mine": true}'
    assert (elsewhere / "manifest.json").is_file() and (root / "step-0000000002").is_symlink()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-0000000")) == [
        "step-0000000000", "step-0000000002", "step-0000000007"]
