"""Checks that make a manifest safe to act on, run on every manifest a reader parses.

The manifest hash catches damage, not an attacker: anyone who edits a manifest can re-sign it.
So before any file is opened or any buffer allocated, every path must stay inside the checkpoint
directory and every size, offset and shape must fit the files the manifest itself declares (whose
real sizes are checked with ``stat`` before a read). A refusal names the manifest field.
"""

from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from plait.universal_ckpt.errors import CheckpointFormatError, PathEscapeError

if TYPE_CHECKING:
    from plait.universal_ckpt.manifest import Manifest, TensorEntry

# A single tensor of more elements than this is refused as absurd (2**48 elements = 256 TiB of bytes).
MAX_ELEMENTS = 1 << 48


def check_relative(rel: object, *, field: str) -> str:
    """``rel`` as a checkpoint-relative path that cannot leave the directory.

    Raises:
        PathEscapeError: not a string, empty, absolute, holding ``..``/``.``/backslashes/NUL.
    """
    if not isinstance(rel, str) or not rel:
        raise PathEscapeError(f"manifest field {field} must be a non-empty relative path, got {rel!r}.", field=field)
    parts = PurePosixPath(rel).parts
    if (rel.startswith(("/", "~")) or "\\" in rel or "\x00" in rel or ":" in rel
            or any(p in ("..", ".") for p in parts) or rel != "/".join(parts)):
        raise PathEscapeError(f"manifest field {field} = {rel!r} would leave the checkpoint directory; "
                              "only plain relative paths (data/..., objects/...) are allowed.", field=field)
    return rel


def inside(ckpt: Path, rel: str, *, field: str) -> Path:
    """``ckpt / rel`` after checking it resolves inside ``ckpt`` (no symlink pointing out).

    Raises:
        PathEscapeError: the path, or a symlink on it, leads outside the checkpoint directory.
    """
    check_relative(rel, field=field)
    path = ckpt / rel
    real, root = os.path.realpath(path), os.path.realpath(ckpt)
    if os.path.commonpath([real, root]) != root:
        raise PathEscapeError(f"manifest field {field} = {rel!r} resolves to {real}, outside the checkpoint "
                              f"directory {root} (a symlink pointing out); refusing to read it.", field=field)
    return path


def _non_negative(value: object, *, field: str, limit: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (limit is not None and value > limit):
        bound = f" and <= {limit}" if limit is not None else ""
        raise CheckpointFormatError(f"manifest field {field} = {value!r} must be an int >= 0{bound}.")
    return value


def _check_entry(full: str, entry: TensorEntry, files: dict[str, int]) -> None:
    field = f"tensors[{full!r}]"
    try:
        itemsize = entry.torch_dtype.itemsize
    except (KeyError, ValueError, AttributeError, TypeError, CheckpointFormatError):
        raise CheckpointFormatError(f"manifest field {field}.dtype = {entry.dtype!r} is not a known dtype.") from None
    for dim, size in enumerate(entry.global_shape):
        _non_negative(size, field=f"{field}.global_shape[{dim}]", limit=MAX_ELEMENTS)
    numel = math.prod(entry.global_shape)
    if numel > MAX_ELEMENTS:
        raise CheckpointFormatError(f"manifest field {field}.global_shape = {list(entry.global_shape)} declares "
                                    f"{numel} elements, more than the {MAX_ELEMENTS} plait accepts.")
    if entry.nbytes != numel * itemsize:
        raise CheckpointFormatError(f"manifest field {field}.nbytes = {entry.nbytes!r} but the shape and dtype give "
                                    f"{numel * itemsize}.")
    for i, piece in enumerate(entry.pieces):
        where = f"{field}.pieces[{i}]"
        check_relative(piece.file, field=f"{where}.file")
        if piece.file not in files:
            raise CheckpointFormatError(f"manifest field {where}.file = {piece.file!r} is not listed in files.")
        offset = _non_negative(piece.offset, field=f"{where}.offset")
        nbytes = _non_negative(piece.nbytes, field=f"{where}.nbytes")
        if offset + nbytes > files[piece.file]:
            raise CheckpointFormatError(f"manifest field {where}: offset {offset} + nbytes {nbytes} runs past the end "
                                        f"of {piece.file} ({files[piece.file]} bytes).")
        if piece.flat_range is not None:
            start, stop = (_non_negative(v, field=f"{where}.flat_range") for v in piece.flat_range)
            if not start <= stop <= numel:
                raise CheckpointFormatError(f"manifest field {where}.flat_range = {list(piece.flat_range)} is "
                                            f"outside [0, {numel}].")
        elif piece.slices is not None:
            if len(piece.slices) != len(entry.global_shape):
                raise CheckpointFormatError(f"manifest field {where}.slices has {len(piece.slices)} dimensions, "
                                            f"the tensor {len(entry.global_shape)}.")
            for dim, (start, stop) in enumerate(piece.slices):
                if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop
                        <= entry.global_shape[dim]):
                    raise CheckpointFormatError(f"manifest field {where}.slices[{dim}] = {[start, stop]} is outside "
                                                f"[0, {entry.global_shape[dim]}].")
        else:
            raise CheckpointFormatError(f"manifest field {where} has neither flat_range nor slices.")


def check_manifest(manifest: Manifest) -> None:
    """Refuse a manifest whose paths leave the directory or whose sizes do not fit its files.

    Raises:
        PathEscapeError: a path field that would leave the checkpoint directory (names it).
        CheckpointFormatError: a size, offset, shape, range or dtype that cannot be right (names it).
    """
    from plait.universal_ckpt.reader import check_coverage  # reader imports the manifest module

    for rel, size in manifest.files.items():
        check_relative(rel, field=f"files[{rel!r}]")
        _non_negative(size, field=f"files[{rel!r}]")
    for rank, record in manifest.objects.items():
        check_relative(record.file, field=f"objects[{rank}].file")
        _non_negative(record.nbytes, field=f"objects[{rank}].nbytes")
        if record.encoding not in ("json", "pickle"):
            raise CheckpointFormatError(f"manifest field objects[{rank}].encoding must be \"json\" or \"pickle\", "
                                        f"got {record.encoding!r}.")
    for full, entry in manifest.tensors.items():
        _check_entry(full, entry, manifest.files)
        problem = check_coverage(entry)
        if problem:
            raise CheckpointFormatError(
                f"manifest field tensors[{full!r}].pieces do not cover the tensor exactly once: {problem}")
