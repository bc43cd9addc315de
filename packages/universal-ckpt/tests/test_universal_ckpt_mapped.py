"""Zero-copy and row-range reads (plait.universal_ckpt.mapped) and the fast chunk checksums."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import plait.universal_ckpt as uc
from plait.universal_ckpt import reader, storage
from plait.universal_ckpt.manifest import MANIFEST_NAME, Layout, Manifest, Piece, TensorEntry, dtype_name
from plait.universal_ckpt.mapped import MappedReader
from plait.universal_ckpt.storage import CHECKSUM_ALGORITHM, chunk_digests, tensor_bytes

CHUNK = 256  # small chunks, so that rows of the test tensors fall in different chunks
# xxhash is a declared dependency; an environment installed --no-deps without it checks sha256.
CHECKED, DIGITS = (CHECKSUM_ALGORITHM, 16) if storage.xxhash is not None else ("sha256", 64)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(24, 10, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16),
            "e": torch.randn(4, 6, 5, generator=gen), "s": torch.tensor(3.5), "i": torch.arange(30).view(10, 3)}


def _write(ckpt, layout: dict[str, list]) -> Manifest:
    """One data file; ``layout[name]`` lists each piece's ``("flat", start, stop)`` or ``("box", slices)``."""
    (ckpt / "data").mkdir(parents=True)
    tensors, blob, offset = {}, bytearray(b"\0"), 1  # offset 1: "w", the first piece, is misaligned
    for name, tensor in _tensors().items():
        pieces = []
        for how, *where in layout.get(name, [("flat", 0, tensor.numel())]):
            if how == "flat":
                part, flat, box = tensor.reshape(-1)[where[0]:where[1]], tuple(where), None
            else:
                box, flat = tuple(where[0]), None
                part = tensor[tuple(slice(a, b) for a, b in box)]
            data = tensor_bytes(part)
            if name != "w":  # "w" stays misaligned (read, not mapped); the others are aligned (mapped)
                pad = -offset % tensor.element_size()
                blob += b"\0" * pad
                offset += pad
            hashes, checksums = chunk_digests(data, CHUNK)
            pieces.append(Piece(file="data/rank-00000.bin", offset=offset, nbytes=len(data), flat_range=flat,
                                slices=box, hashes=hashes, checksums=checksums))
            blob += data
            offset += len(data)
        tensors[f"model/{name}"] = TensorEntry(key="model", name=name, kind="parameter",
                                               global_shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                                               nbytes=tensor.numel() * tensor.element_size(), pieces=tuple(pieces))
    (ckpt / "data/rank-00000.bin").write_bytes(bytes(blob))
    manifest = Manifest(step=0, layout=Layout(), tensors=tensors, objects={}, files={"data/rank-00000.bin": len(blob)},
                        chunk_bytes=CHUNK, checksum_algorithm=CHECKSUM_ALGORITHM)
    (ckpt / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


SPLIT = {"w": [("flat", 0, 95), ("flat", 95, 240)],  # a ZeRO-like flat split inside a row
         "e": [("box", [[0, 4], [0, 3], [0, 5]]), ("box", [[0, 4], [3, 6], [0, 5]])],  # split along dim 1
         "i": [("box", [[0, 6], [0, 3]]), ("box", [[6, 10], [0, 3]])]}


@pytest.mark.parametrize("layout", [{}, SPLIT], ids=["whole-pieces", "split-pieces"])
def test_tensor_and_rows_equal_slicing(tmp_path, layout):
    manifest = _write(tmp_path, layout)
    expected = _tensors()
    mapped = MappedReader(tmp_path, manifest)
    for name, tensor in expected.items():
        entry = manifest.tensors[f"model/{name}"]
        got = mapped.tensor(entry)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        if tensor.dim() == 0:
            with pytest.raises(ValueError, match="0-d"):
                mapped.rows(entry, 0, 1)
            continue
        rows = tensor.shape[0]
        for start, stop in [(0, rows), (0, 1), (rows // 2, rows), (1, rows - 1), (rows, rows)]:
            assert torch.equal(mapped.rows(entry, start, stop), tensor[start:stop]), (name, start, stop)
            whole = mapped.tensor_for_rows(entry, start, stop)
            assert whole.shape == tensor.shape and torch.equal(whole[start:stop], tensor[start:stop]), name
        with pytest.raises(ValueError, match="outside"):
            mapped.rows(entry, 0, rows + 1)


def test_whole_aligned_piece_is_a_view_of_the_file(tmp_path, monkeypatch):
    manifest = _write(tmp_path, {})
    calls, original = [], reader.read_verified
    monkeypatch.setattr(reader, "read_verified", lambda *a, **k: calls.append(a[1]) or original(*a, **k))
    mapped = MappedReader(tmp_path, manifest)
    expected = _tensors()
    aligned = {e.name for e in manifest.tensors.values() if MappedReader.whole_piece(e) is not None}
    assert "s" in aligned and "w" not in aligned  # "w" sits at offset 1 (misaligned): read, not mapped
    got = {name: mapped.tensor(manifest.tensors[f"model/{name}"]) for name in expected}
    assert len(calls) == len(expected) - len(aligned)
    mapped.close()  # the views keep their mapping alive
    del mapped
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def _flip(ckpt, manifest: Manifest, name: str, byte: int) -> None:
    piece = manifest.tensors[f"model/{name}"].pieces[0]
    path = ckpt / piece.file
    data = bytearray(path.read_bytes())
    data[piece.offset + byte] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", [{}, SPLIT], ids=["whole-pieces", "split-pieces"])
def test_rows_check_only_their_chunks(tmp_path, layout):
    manifest = _write(tmp_path, layout)
    entry = manifest.tensors["model/w"]  # 24 rows of 40 bytes: rows 0-5 in chunk 0 of the first piece
    _flip(tmp_path, manifest, "w", 10)
    mapped = MappedReader(tmp_path, manifest)
    for call in (lambda: mapped.tensor(entry), lambda: mapped.rows(entry, 0, 2),
                 lambda: mapped.tensor_for_rows(entry, 0, 12)):
        with pytest.raises(uc.CheckpointIntegrityError, match=f"rank-00000.bin: {CHECKED}") as err:
            call()
        assert len(err.value.expected) == DIGITS
    assert torch.equal(mapped.rows(entry, 12, 24), _tensors()["w"][12:])  # chunks after the damage
    unchecked = MappedReader(tmp_path, manifest, verify=False).tensor(entry)
    assert not torch.equal(unchecked, _tensors()["w"])  # verify=False hands the damaged bytes over


def test_split_rows_outside_are_nan_and_reads_are_ranges(tmp_path, monkeypatch):
    manifest = _write(tmp_path, SPLIT)
    entry = manifest.tensors["model/w"]
    spans = []
    original = reader.read_verified

    def counting(path, rel, offset, nbytes, *, start, stop, **kwargs):
        spans.append(stop - start)
        return original(path, rel, offset, nbytes, start=start, stop=stop, **kwargs)

    monkeypatch.setattr(reader, "read_verified", counting)
    whole = MappedReader(tmp_path, manifest, verify=False).tensor_for_rows(entry, 12, 18)
    assert sum(spans) == 6 * 10 * 4  # only the rows' bytes
    assert torch.isnan(whole[:12]).all() and torch.isnan(whole[18:]).all()
    assert torch.equal(whole[12:18], _tensors()["w"][12:18])
    ints = manifest.tensors["model/i"]  # not floating: read whole
    assert torch.equal(MappedReader(tmp_path, manifest).tensor_for_rows(ints, 0, 3), _tensors()["i"])


def test_truncated_or_missing_file_is_refused_before_mapping(tmp_path):
    manifest = _write(tmp_path, {})
    path = tmp_path / "data/rank-00000.bin"
    path.write_bytes(path.read_bytes()[:-5])
    last = manifest.tensors["model/i"]  # the last piece: mapped, and now cut short
    assert MappedReader.whole_piece(last) is not None
    with pytest.raises(uc.CheckpointIntegrityError, match="truncated"):
        MappedReader(tmp_path, manifest).tensor(last)
    path.unlink()
    with pytest.raises(uc.CheckpointIntegrityError, match="missing"):
        MappedReader(tmp_path, manifest).tensor(last)


def test_saves_store_checksums_and_old_manifests_still_verify(tmp_path):
    pytest.importorskip("xxhash")
    model = torch.nn.Linear(64, 48)
    uc.save({"model": model}, tmp_path, step=1)
    ckpt = uc.latest(tmp_path)
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert body["checksum_algorithm"] == CHECKSUM_ALGORITHM
    assert all(len(p["checksums"]) == len(p["hashes"]) for e in body["tensors"].values() for p in e["pieces"])
    # A checkpoint written before checksums existed: loads check its sha256 chunks instead.
    manifest = uc.read_manifest(ckpt)
    old = dataclasses.replace(manifest, checksum_algorithm=None, tensors={
        full: dataclasses.replace(e, pieces=tuple(dataclasses.replace(p, checksums=None) for p in e.pieces))
        for full, e in manifest.tensors.items()})
    text = old.to_json()
    assert "checksum" not in text
    (ckpt / MANIFEST_NAME).write_text(text)
    manifest = uc.read_manifest(ckpt)
    entry = manifest.tensors["model/weight"]
    assert torch.equal(MappedReader(ckpt, manifest).tensor(entry), model.weight.detach())
    piece = entry.pieces[0]
    data = bytearray((ckpt / piece.file).read_bytes())
    data[piece.offset + 3] ^= 1
    (ckpt / piece.file).write_bytes(bytes(data))
    with pytest.raises(uc.CheckpointIntegrityError, match="sha256"):
        MappedReader(ckpt, manifest).tensor(entry)
    assert math.prod(entry.global_shape) == 64 * 48
