"""Non-tensor state as JSON: every plain value round-trips exactly and no unpickler runs on load."""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import math
import pickle
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import plait.universal_ckpt as uc
from plait.universal_ckpt import object_json, safe_objects
from plait.universal_ckpt.manifest import _body_hash


class Shade(enum.Enum):
    DARK = 1


def _same(a, b) -> bool:
    """Equal values of exactly the same types, all the way down (tuples stay tuples, int keys ints)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad \
            and torch.equal(a.detach().view(-1).view(torch.uint8), b.detach().view(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes() and a.shape == b.shape
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k, l) and _same(a[k], b[l]) for k, l in zip(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, argparse.Namespace):
        return _same(vars(a), vars(b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _training_state(seed: int) -> dict:
    """Optimizer, LambdaLR inside SequentialLR, GradScaler, RNG: the objects of a real resume."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95))
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [warm, torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)], milestones=[2])
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "rng": uc.RNGState()}


PLAIN = {
    "hyper_parameters": {"lr": 3e-4, "betas": (0.9, 0.95), "layers": [4, 4], "name": "gpt", "tied": True,
                         "dropout": None},
    "hparams_name": "kwargs",
    "nested": {1: (2, (3, {4: "four", (5, 6): [7.5, float("inf"), float("-inf"), -0.0]})),
               "$plait": "a user key that looks like the tag", 2.5: b"\x00\xff"},
    "ordered": OrderedDict([("b", 1), ("a", 2)]),
    "odd": [set([1, 2]), frozenset(["x"]), bytearray(b"ab"), complex(1.5, -2.0), float("nan"), 2**80],
    "torch": [torch.bfloat16, torch.device("cpu"), torch.Size([2, 3]), torch.arange(6).reshape(2, 3),
              torch.tensor(True), torch.empty(0, 4), torch.randn(3, dtype=torch.float64).requires_grad_()],
    "numpy": [np.arange(5, dtype=np.uint32), np.float32(1.25), np.int64(-3), np.bool_(False)],
    "args": argparse.Namespace(lr=0.1, dims=(4, 3)),
}


def test_plain_values_round_trip_exactly():
    data = object_json.encode(PLAIN)
    assert _same(object_json.decode(data, file="f"), PLAIN)


def test_resume_state_is_json_and_loads_without_any_unpickler(tmp_path, monkeypatch):
    state = _training_state(0)
    uc.save({**state, "extra": dict(PLAIN)}, tmp_path / "r", step=3)
    expected = (torch.rand(3), np.random.rand())
    ckpt = uc.latest(tmp_path / "r")
    record = uc.read_manifest(ckpt).objects[0]
    assert (record.encoding, record.file) == ("json", "objects/rank-00000.json")
    json.loads((ckpt / record.file).read_text())  # the file is JSON
    assert not list((ckpt / "objects").glob("*.pt"))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("an unpickler ran while loading a JSON objects file")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    target = {**_training_state(1), "extra": None}
    torch.manual_seed(99)
    uc.load(target, tmp_path / "r")
    assert torch.equal(target["model"].weight, state["model"].weight)
    assert _same(target["opt"].state_dict()["param_groups"], state["opt"].state_dict()["param_groups"])
    assert _same(target["sched"].state_dict(), state["sched"].state_dict())
    assert _same(target["scaler"].state_dict(), state["scaler"].state_dict())
    assert _same(target["extra"], PLAIN)
    assert torch.equal(torch.rand(3), expected[0]) and np.random.rand() == expected[1]


def test_value_json_cannot_carry_falls_back_to_the_restricted_pickle(tmp_path):
    uc.register_safe_types(Shade)
    uc.save({"extra": {"shade": Shade.DARK, "n": 1}}, tmp_path / "r", step=1)
    record = uc.read_manifest(uc.latest(tmp_path / "r")).objects[0]
    assert (record.encoding, record.file) == ("pickle", "objects/rank-00000.pt")
    state: dict = {"extra": None}
    uc.load(state, tmp_path / "r")
    assert state["extra"] == {"shade": Shade.DARK, "n": 1}


def test_allow_pickle_with_plain_values_writes_json_and_needs_no_trust(tmp_path):
    uc.save({"extra": {"n": (1, 2)}}, tmp_path / "r", step=1, allow_pickle=True)
    manifest = uc.read_manifest(uc.latest(tmp_path / "r"))
    assert manifest.objects[0].encoding == "json" and not manifest.pickled_objects
    state: dict = {"extra": None}
    uc.load(state, tmp_path / "r")
    assert state["extra"] == {"n": (1, 2)}


def _replant(ckpt: Path, text: str, **fields) -> None:
    """Write ``text`` as rank 0's objects file and re-sign the manifest, as an attacker can."""
    path = ckpt / "objects/rank-00000.json"
    path.write_text(text)
    body = json.loads((ckpt / "manifest.json").read_text())
    body.pop("manifest_hash")
    data = path.read_bytes()
    body["objects"]["0"].update(nbytes=len(data), hash=hashlib.sha256(data).hexdigest(), **fields)
    body["manifest_hash"] = _body_hash(body)
    (ckpt / "manifest.json").write_text(json.dumps(body))


@pytest.mark.parametrize("objects, match", [
    ({"extra": {"$plait": "pickle", "data": "gASV"}}, r"\['extra'\].*unknown kind 'pickle'"),
    ({"extra": {"$plait": "tensor", "dtype": "float32", "shape": [1 << 40], "base64": "AAAA"}},
     r"\['extra'\].*data bytes for shape"),
    ({"extra": {"$plait": "dtype", "name": "manual_seed"}}, "not a torch dtype"),
    ({"extra": {"$plait": "ndarray", "dtype": "|O", "shape": [1], "base64": ""}}, "not a plain numeric type"),
    ({"extra": {"$plait": "tuple"}}, "tuple lacks field 'items'"),
])
def test_malformed_json_objects_are_refused_naming_file_and_key(tmp_path, objects, match):
    uc.save({"extra": {"n": 1}}, tmp_path / "r", step=1)
    ckpt = uc.latest(tmp_path / "r")
    _replant(ckpt, json.dumps({"format": "plait-objects", "version": 1, "objects": objects}))
    with pytest.raises(uc.CheckpointFormatError, match=match) as info:
        uc.load({"extra": None}, ckpt)
    assert "objects/rank-00000.json" in str(info.value)


def test_bare_nan_and_unknown_encoding_refused(tmp_path):
    uc.save({"extra": {"n": 1}}, tmp_path / "r", step=1)
    ckpt = uc.latest(tmp_path / "r")
    _replant(ckpt, '{"format": "plait-objects", "version": 1, "objects": {"extra": NaN}}')
    with pytest.raises(uc.CheckpointFormatError, match="NaN"):
        uc.load({"extra": None}, ckpt)
    _replant(ckpt, '{"format": "plait-objects", "version": 1, "objects": {"extra": 1}}', encoding="marshal")
    with pytest.raises(uc.CheckpointFormatError, match=r"objects\[0\]\.encoding"):
        uc.load({"extra": None}, ckpt)


def test_encoding_decision_is_per_rank_file():
    data, encoding = safe_objects.encode_objects({"a": (1, 2)}, allow_pickle=False)
    assert encoding == "json" and safe_objects.decode_objects(data, encoding="json", file="f", trusted=True) \
        == {"a": (1, 2)}
    with pytest.raises(uc.UnsafeObjectError, match="builtin_function"):
        safe_objects.encode_objects({"a": print}, allow_pickle=False)
