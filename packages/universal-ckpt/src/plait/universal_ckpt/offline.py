"""Writing a checkpoint from one process, tensor by tensor: the target of every importer.

Importers (DCP, DeepSpeed, HF) produce whole tensors one at a time; this writes them into a
single data file as full pieces and commits with the same protocol as a distributed save
(``.tmp`` directory, fsync, rename, ``latest``), so an interrupted conversion never leaves
something that looks like a checkpoint. Memory stays at one tensor when the input is lazy.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from plait.universal_ckpt import directory
from plait.universal_ckpt.errors import CheckpointExistsError
from plait.universal_ckpt.manifest import (
    DEFAULT_CHUNK_BYTES,
    HASH_ALGORITHM,
    MANIFEST_NAME,
    Layout,
    Manifest,
    ObjectFile,
    Piece,
    TensorEntry,
    dtype_name,
)
from plait.universal_ckpt.safe_objects import encode_objects
from plait.universal_ckpt.storage import (
    CHECKSUM_ALGORITHM,
    chunk_digests,
    file_digest,
    fsync_dir,
    tensor_bytes,
    write_durable,
)

DATA_FILE = "data/rank-00000.bin"


def write_offline(root: str | os.PathLike, *, step: int, tensors: Iterable[tuple[str, str, str, torch.Tensor]],
                  objects: dict[int, dict[str, Any]] | None = None, layout: Layout | None = None,
                  user_meta: dict | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  progress: Callable[[int], None] | None = None, allow_pickle: bool = False) -> Path:
    """Write and commit a checkpoint from whole tensors.

    Args:
        root: the checkpoint root (created); the checkpoint lands in ``root/step-<step>``.
        step: its step.
        tensors: ``(key, name, kind, tensor)`` tuples, consumed one at a time; a fifth item, when
            present, is the tensor's model-parallel pattern (:class:`TensorLayout` JSON) or None.
        objects: rank -> {key: object} (non-tensor state per rank): plain values, tensors and the
            safe-type allowlist of :mod:`plait.universal_ckpt.safe_objects`.
        layout: the layout to record (default: world size 1).
        user_meta: JSON-able dict for the manifest.
        chunk_bytes: hash chunk size.
        progress: called with the bytes of each tensor written.
        allow_pickle: store objects outside the allowlist anyway (recorded in the manifest; a
            load then needs ``trust_pickled_objects=True``).

    Returns:
        The committed checkpoint directory.

    Raises:
        CheckpointExistsError: ``step`` is already committed under ``root``.
        UnsafeObjectError: an object outside the allowlist without ``allow_pickle`` (nothing written).
        OSError: the write failed (the ``.tmp`` directory is removed, nothing is committed).
    """
    root = Path(root)
    if (root / directory.step_dir_name(step)).exists():
        raise CheckpointExistsError(f"checkpoint step {step} already exists in {root}; choose another step.")
    root.mkdir(parents=True, exist_ok=True)
    # refused before anything is written
    serialised = {rank: (state, *encode_objects(state, allow_pickle=allow_pickle))
                  for rank, state in (objects or {}).items()}
    directory.clean_leftovers(root)
    tmp = root / directory.tmp_dir_name(step)
    try:
        (tmp / "data").mkdir(parents=True)
        (tmp / "objects").mkdir()
        entries, size = _write_tensors(tmp, tensors, chunk_bytes, progress)
        records = {}
        for rank, (state, data, encoding) in sorted(serialised.items()):
            rel = f"objects/rank-{rank:05d}.{'json' if encoding == 'json' else 'pt'}"
            write_durable(tmp / rel, data)
            records[rank] = ObjectFile(rank=rank, file=rel, nbytes=len(data), hash=file_digest(tmp / rel),
                                       keys=tuple(sorted(state)), encoding=encoding)
        manifest = Manifest(step=step, layout=layout or Layout(), tensors=entries, objects=records,
                            files={DATA_FILE: size} if entries else {}, chunk_bytes=chunk_bytes,
                            checksum_algorithm=CHECKSUM_ALGORITHM if any(
                                p.checksums is not None for e in entries.values() for p in e.pieces) else None,
                            created_unix=time.time(), user_meta=user_meta or {},
                            pickled_objects=allow_pickle and any(r.encoding == "pickle" for r in records.values()))
        fsync_dir(tmp / "data")
        fsync_dir(tmp / "objects")
        write_durable(tmp / MANIFEST_NAME, manifest.to_json().encode())
        final = directory.commit(root, step)
    except BaseException:
        directory.clean_leftovers(root)
        raise
    directory.point_latest(root, step)
    return final


def _write_tensors(tmp: Path, tensors: Iterable[tuple[str, str, str, torch.Tensor]], chunk_bytes: int,
                   progress: Callable[[int], None] | None) -> tuple[dict[str, TensorEntry], int]:
    entries: dict[str, TensorEntry] = {}
    offset = 0
    # The digests are computed on a second thread while the bytes are written (hashlib and the
    # write both release the GIL): the two are the bulk of an import's time.
    with open(tmp / DATA_FILE, "xb", buffering=0) as file, ThreadPoolExecutor(max_workers=1) as pool:
        for key, name, kind, tensor, *rest in tensors:
            data = tensor_bytes(tensor)
            digests = pool.submit(chunk_digests, data, chunk_bytes, HASH_ALGORITHM)
            view = data
            while len(view):
                view = view[file.write(view):]
            hashes, checksums = digests.result()
            full = f"{key}/{name}"
            numel = math.prod(tensor.shape)
            entries[full] = TensorEntry(
                key=key, name=name, kind=kind, global_shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                nbytes=len(data), pieces=(Piece(file=DATA_FILE, offset=offset, nbytes=len(data), flat_range=(0, numel),
                                                slices=None, hashes=hashes, checksums=checksums),),
                pattern=rest[0] if rest else None)
            offset += len(data)
            if progress is not None:
                progress(len(data))
        os.fsync(file.fileno())
    if not entries:
        (tmp / DATA_FILE).unlink()
    return entries, offset
