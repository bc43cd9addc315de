"""A deterministic manifest fuzzer: every damaged or crafted manifest is refused with a typed error.

Each input is a copy of one small valid checkpoint whose manifest was edited (and re-signed, as an
attacker can) or damaged (truncated, bit-flipped). Loading and verifying it must raise a
:class:`plait.universal_ckpt.CheckpointError` subclass, nothing else; nothing outside the
checkpoint directory (a sentinel directory beside it) and nothing inside it may change; and no
allocation may exceed the real size of the files (an absurd shape is refused before allocating).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import plait.universal_ckpt as uc
from plait.universal_ckpt.manifest import _body_hash

SEED = 33
BAD_PATHS = ["../x.bin", "../../etc/passwd", "/etc/passwd", "data/../../x", "data/./rank-00000.bin", "",
             "data\\..\\x", "C:/x", "data/rank-00000.bin\x00", "~/x", "data//rank-00000.bin"]
HUGE = [2**62, 2**63 - 1, -1, -(2**40)]


def _state() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt}


def _pieces(body: dict) -> list[dict]:
    return [p for e in body["tensors"].values() for p in e["pieces"]]


def _entry(body: dict, rng: random.Random) -> dict:
    return body["tensors"][rng.choice(sorted(body["tensors"]))]


def _traversal(body: dict, rng: random.Random) -> str:
    bad, where = rng.choice(BAD_PATHS), rng.choice(["piece", "files", "objects"])
    if where == "piece":
        rng.choice(_pieces(body))["file"] = bad
    elif where == "files":
        old = rng.choice(sorted(body["files"]))
        body["files"][bad] = body["files"].pop(old)
        for piece in _pieces(body):
            piece["file"] = bad if piece["file"] == old else piece["file"]
    else:
        body["objects"]["0"]["file"] = bad
    return "traversal path"


def _absurd(body: dict, rng: random.Random) -> str:
    entry, value = _entry(body, rng), rng.choice(HUGE)
    piece = rng.choice(entry["pieces"])
    field = rng.choice(["shape", "nbytes", "offset", "piece_nbytes", "flat_range", "file_size", "object_size"])
    if field == "shape":
        entry["global_shape"] = [value] + entry["global_shape"][1:] if entry["global_shape"] else [value]
    elif field == "nbytes":
        entry["nbytes"] = value
    elif field == "offset":
        piece["offset"] = value
    elif field == "piece_nbytes":
        piece["nbytes"] = value
    elif field == "flat_range" and piece["flat_range"] is not None:
        piece["flat_range"] = [0, value]
    elif field == "file_size":
        body["files"][piece["file"]] = value
    else:
        body["objects"]["0"]["nbytes"] = value
    return "absurd size/offset/shape"


def _duplicate(body: dict, rng: random.Random) -> str:
    entry = _entry(body, rng)
    piece = copy.deepcopy(rng.choice(entry["pieces"]))
    if rng.random() < 0.5 and piece["flat_range"] is not None:
        start, stop = piece["flat_range"]
        piece["flat_range"] = [max(0, start - 1), stop - 1] if stop > 1 else [0, 1]
    entry["pieces"].append(piece)
    return "duplicate/overlapping piece"


def _wrong_type(body: dict, rng: random.Random) -> str:
    entry = _entry(body, rng)
    choice = rng.randrange(6)
    if choice == 0:
        entry["dtype"] = rng.choice(["float128", "int4x", "", "torch.float32"])
    elif choice == 1:
        entry["dtype"] = rng.choice(["int8", "float64", "bool"]) if entry["dtype"] == "float32" else "float32"
    elif choice == 2:
        entry["global_shape"] = rng.choice(["4x8", [4.5], [None], {"a": 1}])
    elif choice == 3:
        rng.choice(entry["pieces"])["offset"] = rng.choice(["0", 1.5, None, [0]])
    elif choice == 4:
        rng.choice(entry["pieces"])["slices"] = [[0, 1]] * 5
        entry["pieces"][0]["flat_range"] = None
    else:
        body["tensors"] = rng.choice([[], "x", None])
    return "wrong dtype/type"


EDITS = [_traversal, _absurd, _duplicate, _wrong_type]


def _damage(text: str, rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        return text[:rng.randrange(len(text))], "truncated JSON"
    data = bytearray(text.encode())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return data.decode("utf-8", errors="replace"), "bit-flipped JSON"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode() + file.read_bytes())
    return h.hexdigest()


def fuzz(workdir: Path, count: int, seed: int = SEED) -> dict:
    """Try ``count`` crafted manifests; return the counts of inputs tried and refused, by kind.

    Raises:
        AssertionError: an input was accepted, raised an untyped error, or changed a file.
    """
    rng = random.Random(seed)
    root = workdir / "root"
    uc.save(_state(), root, step=1)
    pristine = uc.latest(root)
    text = (pristine / "manifest.json").read_text()
    sentinel = workdir / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("do not touch")
    before = _digest(sentinel)
    tried, refused, errors = Counter(), Counter(), Counter()
    limit = sum(p.stat().st_size for p in pristine.rglob("*") if p.is_file())
    for i in range(count):
        ckpt = workdir / f"case-{i % 4}"
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(pristine, ckpt)
        if rng.random() < 0.25:
            new_text, kind = _damage(text, rng)
        else:
            body = json.loads(text)
            body.pop("manifest_hash")
            kind = rng.choice(EDITS)(body, rng)
            body["manifest_hash"] = _body_hash(body)
            new_text = json.dumps(body)
        (ckpt / "manifest.json").write_text(new_text)
        inside = _digest(ckpt)
        tried[kind] += 1
        for action in (uc.load, uc.verify_checkpoint):
            try:
                action(_state(), ckpt) if action is uc.load else action(ckpt)
            except uc.CheckpointError as exc:
                errors[type(exc).__name__] += 1
                continue
            except Exception as exc:  # the fuzzer's finding: an untyped error
                raise AssertionError(f"case {i} ({kind}) raised {type(exc).__name__}: {exc}\n{new_text}") from exc
            raise AssertionError(f"case {i} ({kind}) was accepted:\n{new_text}")
        refused[kind] += 1
        assert _digest(ckpt) == inside, f"case {i} ({kind}) changed the checkpoint"
        assert _digest(sentinel) == before, f"case {i} ({kind}) touched a file outside the checkpoint"
    assert sorted(p.name for p in workdir.iterdir()) == sorted(
        ["root", "sentinel", *{f"case-{i % 4}" for i in range(count)}]), "a case wrote outside its directory"
    return {"seed": seed, "inputs_tried": sum(tried.values()), "inputs_refused": sum(refused.values()),
            "by_kind": {k: {"tried": tried[k], "refused": refused[k]} for k in sorted(tried)},
            "errors": dict(sorted(errors.items())), "checkpoint_bytes": limit}


@pytest.mark.timeout(120)
def test_fuzzed_manifests_all_refused(tmp_path):
    result = fuzz(tmp_path, 80)  # the results file holds a longer run of the same fuzzer
    assert result["inputs_refused"] == result["inputs_tried"] == 80
    assert len(result["by_kind"]) == 6
