"""Reading a checkpoint: the manifest, file checks, and any piece of any tensor in any layout.

:func:`read_region` is the resharding engine. Given the pieces a checkpoint stores and the piece
a target rank wants (a flat range or a box of per-dimension slices), it reads only the byte
ranges of the stored pieces that overlap (widened to whole hash chunks when verifying) and
places them. Flat-to-flat, the common ZeRO case, is pure interval arithmetic; any other mix
maps the wanted elements through their global row-major index, which costs one int64 index per
wanted element and is exact for every combination; it then reads only the runs of a stored
piece that hold wanted elements (a column block of a row-major box is read row by row).
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import torch

from plait.kernels.sharded_state import ShardSpec, flat_overlap
from plait.universal_ckpt.errors import (
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    UnsafeObjectError,
)
from plait.universal_ckpt.manifest import MANIFEST_NAME, Manifest, ObjectFile, Piece, TensorEntry
from plait.universal_ckpt.manifest_checks import inside
from plait.universal_ckpt.safe_objects import decode_objects
from plait.universal_ckpt.storage import CHECKSUM_ALGORITHM, check_chunks, pick_digests, read_verified


def read_manifest(ckpt: Path) -> Manifest:
    """Parse ``ckpt/manifest.json``.

    Raises:
        CheckpointNotFoundError: no manifest (a missing or foreign directory).
        CheckpointFormatError: a damaged, foreign or newer-format manifest.
    """
    path = ckpt / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointNotFoundError(f"{ckpt} is not a plait checkpoint: it has no {MANIFEST_NAME}.")
    return Manifest.from_json(path.read_text(), source=str(path))


def check_files(ckpt: Path, manifest: Manifest) -> None:
    """Every data and object file exists with the size the manifest records (cheap: stat only).

    Raises:
        CheckpointIntegrityError: naming the first missing or wrongly sized file.
    """
    sizes = dict(manifest.files)
    sizes.update({obj.file: obj.nbytes for obj in manifest.objects.values()})
    for rel, expected in sorted(sizes.items()):
        try:
            actual = os.stat(inside(ckpt, rel, field=f"files[{rel!r}]")).st_size
        except FileNotFoundError as exc:
            raise CheckpointIntegrityError(f"checkpoint file {rel} is missing from {ckpt}.", file=rel,
                                           expected=f"{expected} bytes", actual="missing") from exc
        if actual != expected:
            raise CheckpointIntegrityError(
                f"checkpoint file {rel}: size expected {expected} bytes, actual {actual} bytes.",
                file=rel, expected=f"{expected} bytes", actual=f"{actual} bytes")


def read_objects(ckpt: Path, manifest: Manifest, rank: int, *, verify: bool, trusted: bool = False) -> dict[str, Any]:
    """The non-tensor state saved by ``rank`` (rank 0's when ``rank`` did not save).

    A JSON object file is parsed, never unpickled. A pickled one (a value JSON cannot carry, or a
    checkpoint in the older format) is read with a restricted unpickler (plain values, tensors,
    the safe-type allowlist) unless ``trusted``; a checkpoint saved with ``allow_pickle=True``
    is refused without ``trusted``.

    Raises:
        CheckpointIntegrityError: the object file's hash differs from the manifest.
        UnsafeObjectError: the file needs ``trust_pickled_objects=True`` (names the file or global).
    """
    if not manifest.objects:
        return {}
    record = manifest.objects.get(rank) or manifest.objects[min(manifest.objects)]
    if manifest.pickled_objects and record.encoding == "pickle" and not trusted:
        raise UnsafeObjectError(
            f"checkpoint {ckpt} was saved with allow_pickle=True: its object files may run code when loaded. "
            "If you trust it, load with trust_pickled_objects=True.", key_path=record.file, type_name="pickle")
    data = _verified_object_bytes(ckpt, manifest, record, verify=verify)
    return decode_objects(data, encoding=record.encoding, file=record.file, trusted=trusted)


def _verified_object_bytes(ckpt: Path, manifest: Manifest, record: ObjectFile, *, verify: bool) -> bytes:
    """An object file's bytes, checked against the manifest's size (and hash when ``verify``)."""
    path = inside(ckpt, record.file, field=f"objects[{record.rank}].file")
    if not path.is_file():
        raise CheckpointIntegrityError(f"checkpoint file {record.file} is missing.", file=record.file,
                                       expected=record.hash, actual="missing")
    actual_size = path.stat().st_size
    if actual_size != record.nbytes:
        raise CheckpointIntegrityError(
            f"checkpoint file {record.file}: size expected {record.nbytes} bytes, actual {actual_size} bytes.",
            file=record.file, expected=f"{record.nbytes} bytes", actual=f"{actual_size} bytes")
    data = path.read_bytes()
    if verify:
        actual = hashlib.new(manifest.hash_algorithm, data).hexdigest()
        if actual != record.hash:
            raise CheckpointIntegrityError(
                f"checkpoint file {record.file}: {manifest.hash_algorithm} expected {record.hash}, actual {actual}.",
                file=record.file, expected=record.hash, actual=actual)
    return data


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def _global_indices(spec: ShardSpec) -> torch.Tensor:
    """Global row-major index of every element of a piece, in the piece's own row-major order."""
    if spec.flat_range is not None:
        return torch.arange(spec.flat_range[0], spec.flat_range[1], dtype=torch.int64)
    index = torch.zeros((), dtype=torch.int64)
    for (start, stop), stride in zip(spec.slices, _strides(spec.global_shape)):
        index = index.unsqueeze(-1) + torch.arange(start, stop, dtype=torch.int64) * stride
    return index.reshape(-1)


def _positions_in_piece(piece: Piece, shape: tuple[int, ...], index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the global ``index`` values a stored piece holds, and where in the piece."""
    if piece.flat_range is not None:
        start, stop = piece.flat_range
        mask = (index >= start) & (index < stop)
        return mask, index[mask] - start
    mask = torch.ones_like(index, dtype=torch.bool)
    pos = torch.zeros_like(index)
    local_strides = _strides(tuple(stop - start for start, stop in piece.slices))
    for (start, stop), size, stride, local_stride in zip(piece.slices, shape, _strides(shape), local_strides):
        coord = (index // stride) % size
        mask &= (coord >= start) & (coord < stop)
        pos += (coord - start) * local_stride
    return mask, pos[mask]


def _read(ckpt: Path, manifest: Manifest, piece: Piece, dtype: torch.dtype, first: int, last: int,
          verify: bool, into: torch.Tensor | None = None) -> torch.Tensor:
    """Elements ``[first, last)`` of a stored piece as a 1-D tensor (``into`` itself when given)."""
    itemsize = dtype.itemsize
    target = None
    if into is not None and into.numel():
        target = memoryview(into.view(torch.uint8).numpy()).cast("B")
    digests, algorithm = pick_digests(piece.hashes, piece.checksums, manifest.hash_algorithm)
    data = read_verified(ckpt / piece.file, piece.file, piece.offset, piece.nbytes,
                         start=first * itemsize, stop=last * itemsize,
                         hashes=digests if verify else None, chunk_bytes=manifest.chunk_bytes,
                         algorithm=algorithm, into=target)
    if into is not None:
        return into
    if len(data) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def _spans(pos: torch.Tensor, itemsize: int, grain: int) -> list[tuple[int, int]]:
    """Element spans ``[first, last)`` of a stored piece that cover ``pos`` and touch no byte
    ``grain`` block (hash chunk when verifying, one byte otherwise) outside them: a column of a
    row-major piece is read row by row, not as one span over everything between its ends."""
    ordered = torch.unique(pos)  # sorted
    gaps = torch.nonzero(ordered[1:] != ordered[:-1] + 1).flatten() + 1
    bounds = list(zip([0, *gaps.tolist()], [*gaps.tolist(), len(ordered)]))
    spans: list[tuple[int, int]] = []
    for lo, hi in bounds:
        first, last = int(ordered[lo]), int(ordered[hi - 1]) + 1
        # Runs whose blocks touch are read together (a block is read, and hashed, once).
        if spans and (first * itemsize) // grain <= (spans[-1][1] * itemsize - 1) // grain + 1:
            spans[-1] = (spans[-1][0], last)
        else:
            spans.append((first, last))
    return spans


def read_region(ckpt: Path, manifest: Manifest, entry: TensorEntry, target: ShardSpec, *,
                verify: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read the part of a saved tensor that ``target`` describes, from whatever pieces hold it.

    Args:
        ckpt: the checkpoint directory.
        manifest: its manifest.
        entry: the saved tensor.
        target: the wanted piece (its global shape must match the entry's).
        verify: check every chunk read against its fast checksum (XXH3-64) where the manifest
            has one, else against its sha256.
        out: optional 1-D CPU tensor of ``target.local_numel`` elements to fill.

    Returns:
        A 1-D tensor of the wanted elements in the target piece's row-major order.

    Raises:
        CheckpointIntegrityError: a hash, size or file problem (names the file).
        CheckpointFormatError: the stored pieces do not cover the wanted region.
    """
    dtype = entry.torch_dtype
    out = torch.empty(target.local_numel, dtype=dtype) if out is None else out
    covered = 0
    if target.flat_range is not None and all(p.flat_range is not None for p in entry.pieces):
        t0 = target.flat_range[0]
        for piece in entry.pieces:
            overlap = flat_overlap(piece.flat_range, target.flat_range)
            if overlap is None:
                continue
            p0 = piece.flat_range[0]
            _read(ckpt, manifest, piece, dtype, overlap[0] - p0, overlap[1] - p0, verify,
                  into=out[overlap[0] - t0:overlap[1] - t0])
            covered += overlap[1] - overlap[0]
    elif target.local_numel:
        index = _global_indices(target)
        for piece in entry.pieces:
            if piece.slices is not None and target.slices is not None and tuple(piece.slices) == tuple(target.slices):
                out[:] = _read(ckpt, manifest, piece, dtype, 0, piece.numel_local, verify)
                covered += piece.numel_local
                continue
            mask, pos = _positions_in_piece(piece, entry.global_shape, index)
            if not pos.numel():
                continue
            spans = _spans(pos, dtype.itemsize, manifest.chunk_bytes if verify else 1)
            firsts = torch.tensor([first for first, _ in spans], dtype=torch.int64)
            lengths = torch.tensor([last - first for first, last in spans], dtype=torch.int64)
            starts = torch.cumsum(lengths, 0) - lengths  # where each span lands in ``buffer``
            buffer = torch.empty(int(lengths.sum()), dtype=dtype)
            for (first, last), at in zip(spans, starts.tolist()):
                _read(ckpt, manifest, piece, dtype, first, last, verify, into=buffer[at:at + last - first])
            span = torch.searchsorted(firsts, pos, right=True) - 1
            out[mask] = buffer[starts[span] + pos - firsts[span]]
            covered += pos.numel()
    if covered != target.local_numel:
        raise CheckpointFormatError(
            f"{entry.full_name}: the stored pieces cover {covered} of the {target.local_numel} elements wanted "
            f"({target.flat_range or target.slices}); the manifest and the data disagree.")
    return out


def read_full(ckpt: Path, manifest: Manifest, entry: TensorEntry, *, verify: bool = True) -> torch.Tensor:
    """The whole saved tensor, consolidated from its pieces, shaped ``global_shape``."""
    spec = ShardSpec(name=entry.full_name, kind=entry.kind, global_shape=entry.global_shape,
                     dtype=entry.torch_dtype, flat_range=(0, math.prod(entry.global_shape)))
    return read_region(ckpt, manifest, entry, spec, verify=verify).reshape(entry.global_shape)


def check_coverage(entry: TensorEntry) -> str | None:
    """Why the pieces of ``entry`` do not tile the tensor exactly once, or None when they do."""
    numel = math.prod(entry.global_shape)
    total = sum(p.numel_local for p in entry.pieces)
    if total != numel:
        return f"{entry.full_name}: pieces hold {total} elements, the tensor has {numel}."
    itemsize = entry.torch_dtype.itemsize
    for piece in entry.pieces:
        if piece.nbytes != piece.numel_local * itemsize:
            return (f"{entry.full_name}: a piece in {piece.file} has {piece.nbytes} bytes for "
                    f"{piece.numel_local} elements.")
    flats = sorted(p.flat_range for p in entry.pieces if p.flat_range is not None)
    for (_, stop), (start, _) in zip(flats, flats[1:]):
        if start < stop:
            return f"{entry.full_name}: stored flat ranges overlap at element {start}."
    boxes = [p.slices for p in entry.pieces if p.slices is not None]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b)):
                return f"{entry.full_name}: stored boxes {a} and {b} overlap."
    return None


def verify_checkpoint(ckpt: Path, *, progress: Any = None) -> Manifest:
    """Check everything: manifest, file sizes, coverage, and the sha256 (and the checksum, where
    stored) of every chunk, and the hash of every object file.

    Args:
        ckpt: a checkpoint directory (or a root; its latest is checked).
        progress: optional callable ``progress(nbytes)`` called as bytes are hashed.

    Returns:
        The manifest when all is well.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, CheckpointIntegrityError: the first problem.
    """
    manifest = read_manifest(ckpt)
    check_files(ckpt, manifest)
    for entry in manifest.tensors.values():
        problem = check_coverage(entry)
        if problem:
            raise CheckpointFormatError(problem)
        for piece in entry.pieces:
            data = read_verified(ckpt / piece.file, piece.file, piece.offset, piece.nbytes, start=0,
                                 stop=piece.nbytes, hashes=piece.hashes, chunk_bytes=manifest.chunk_bytes,
                                 algorithm=manifest.hash_algorithm)
            digests, algorithm = pick_digests(piece.hashes, piece.checksums, manifest.hash_algorithm)
            if algorithm == CHECKSUM_ALGORITHM:  # a load checks these: they must agree with the hashes too
                check_chunks(data, piece.file, piece.offset, piece.nbytes, 0, piece.nbytes, digests=digests,
                             chunk_bytes=manifest.chunk_bytes, algorithm=algorithm)
            if progress is not None:
                progress(piece.nbytes)
    for record in manifest.objects.values():  # hashed as bytes only: verify never unpickles
        _verified_object_bytes(ckpt, manifest, record, verify=True)
    return manifest
