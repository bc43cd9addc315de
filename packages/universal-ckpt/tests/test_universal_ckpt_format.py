"""The README's on-disk format is enough to read a checkpoint: a reader using only json, hashlib
and numpy (no plait code) gets the same tensors and checks the same hashes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig, small_model, train_steps

_NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int64": np.int64,
          "int32": np.int32, "uint8": np.uint8, "bool": np.bool_}


def independent_read(root: Path, full_name: str) -> np.ndarray:
    """Follow README "On-disk format" literally."""
    name = (root / "latest").read_text().strip()
    ckpt = root / name
    body = json.loads((ckpt / "manifest.json").read_text())
    stored = body.pop("manifest_hash")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256(canonical.encode("utf-8")).hexdigest() == stored
    assert body["magic"] == "plait-universal-ckpt" and body["format_version"] == 1
    entry = body["tensors"][full_name]
    dtype = np.dtype(_NUMPY[entry["dtype"]])
    numel = int(np.prod(entry["global_shape"])) if entry["global_shape"] else 1
    out = np.empty(numel, dtype=dtype)
    chunk = body["chunk_bytes"]
    for piece in entry["pieces"]:
        with open(ckpt / piece["file"], "rb") as file:
            file.seek(piece["offset"])
            raw = file.read(piece["nbytes"])
        for index, digest in enumerate(piece["hashes"]):
            assert hashlib.new(body["hash_algorithm"], raw[index * chunk:(index + 1) * chunk]).hexdigest() == digest
        start, stop = piece["flat_range"]
        out[start:stop] = np.frombuffer(raw, dtype=dtype)
    return out.reshape(entry["global_shape"])


def save_sharded(root: str) -> None:
    model = small_model(0)
    engine = ToyZero(model, ToyZeroConfig(stage=3))
    train_steps(model, engine, range(1))
    uc.save({"zero": engine}, root, step=1)


def test_independent_reader_matches(tmp_path):
    run_distributed(save_sharded, 3, str(tmp_path), timeout=90)
    ckpt = uc.latest(tmp_path)
    manifest = uc.read_manifest(ckpt)
    checked = 0
    for full_name, entry in manifest.tensors.items():
        if entry.dtype in _NUMPY:
            ours = uc.read_full(ckpt, manifest, entry)
            theirs = torch.from_numpy(independent_read(tmp_path, full_name).copy())
            assert torch.equal(ours, theirs.reshape(ours.shape)), full_name
            checked += 1
    assert checked == len(manifest.tensors) and any(len(e.pieces) > 1 for e in manifest.tensors.values())
