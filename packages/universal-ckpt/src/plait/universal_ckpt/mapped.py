"""Zero-copy reads for serving: a saved tensor, or some of its rows, as a view of the mapped file.

A server that streams weights into its own parameters (vLLM's ``load_weights``) copies every
tensor it is given, so reading a tensor into fresh memory first means a second copy and a page
fault per fresh page. Here a tensor stored as one whole piece is handed out as a view of the data
file mapped copy-on-write (``mmap`` ``MAP_PRIVATE``): the bytes go from the page cache straight
into the consumer's parameter, as with safetensors. Only a tensor split over several pieces (a
ZeRO or tensor-parallel save) is consolidated, read with ``readinto`` straight into its buffer.

Checks: every chunk a view covers is checked against its fast checksum (XXH3-64, see
:mod:`~plait.universal_ckpt.storage`; sha256 where the manifest has none) before the view is
returned, so the consumer's copy finds the bytes hot in cache. Asked for rows ``[a, b)`` of
dim 0 (what one tensor-parallel rank keeps of a column-split weight), only the chunks holding
those rows are touched and checked; a consumer that reads outside them sees the file's bytes,
unchecked, never other values.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch

from plait.kernels.sharded_state import ShardSpec
from plait.universal_ckpt.errors import CheckpointIntegrityError
from plait.universal_ckpt.manifest import Manifest, Piece, TensorEntry
from plait.universal_ckpt.reader import read_region
from plait.universal_ckpt.storage import check_chunks, chunk_bounds, pick_digests


class MappedReader:
    """Reads tensors of one checkpoint as views of its mapped data files where the layout allows.

    Args:
        ckpt: the checkpoint directory.
        manifest: its manifest (sizes already checked with :func:`~plait.universal_ckpt.reader.check_files`
            is best: a file shorter than its pieces is refused here too, before it is mapped).
        verify: check the chunks read (default True).

    Views keep their file's mapping alive; a mapping goes away with the last tensor that views it.
    """

    def __init__(self, ckpt: Path, manifest: Manifest, *, verify: bool = True) -> None:
        self.ckpt = Path(ckpt)
        self.manifest = manifest
        self.verify = verify
        self._maps: dict[str, mmap.mmap] = {}

    def close(self) -> None:
        """Drop this reader's references to its mappings (views still held keep theirs)."""
        self._maps.clear()

    def _map(self, piece: Piece) -> mmap.mmap:
        mapped = self._maps.get(piece.file)
        if mapped is None:
            path = self.ckpt / piece.file
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise CheckpointIntegrityError(f"checkpoint file {piece.file} is missing.", file=piece.file,
                                               expected="present", actual="missing") from exc
            try:
                mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # writable for torch, never written back
            finally:
                os.close(fd)
            self._maps[piece.file] = mapped
        if len(mapped) < piece.offset + piece.nbytes:  # touching past the end would be SIGBUS
            raise CheckpointIntegrityError(
                f"checkpoint file {piece.file} is truncated: needed bytes up to {piece.offset + piece.nbytes}, "
                f"file ends at {len(mapped)}.", file=piece.file, expected=f">= {piece.offset + piece.nbytes} bytes",
                actual=f"{len(mapped)} bytes")
        return mapped

    def _check(self, piece: Piece, mapped: mmap.mmap, start: int, stop: int) -> None:
        if not self.verify:
            return
        digests, algorithm = pick_digests(piece.hashes, piece.checksums, self.manifest.hash_algorithm)
        lo, hi = chunk_bounds(start, stop, piece.nbytes, self.manifest.chunk_bytes)
        with memoryview(mapped) as whole:
            view = whole[piece.offset + lo:piece.offset + hi]
            try:
                check_chunks(view, piece.file, piece.offset, piece.nbytes, lo, hi, digests=digests,
                             chunk_bytes=self.manifest.chunk_bytes, algorithm=algorithm)
            finally:
                view.release()

    @staticmethod
    def whole_piece(entry: TensorEntry) -> Piece | None:
        """The one piece holding all of ``entry`` at an offset aligned to its dtype, or None."""
        if len(entry.pieces) != 1 or not entry.nbytes:
            return None
        piece = entry.pieces[0]
        if piece.offset % entry.torch_dtype.itemsize:
            return None
        return piece

    def _view(self, entry: TensorEntry, piece: Piece, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a whole-piece tensor, checked, as a view of the mapping."""
        mapped = self._map(piece)
        row = _row_bytes(entry)
        self._check(piece, mapped, start * row, stop * row)
        dtype = entry.torch_dtype
        count = (stop - start) * row // dtype.itemsize
        if not count:
            return torch.empty((0, *entry.global_shape[1:]), dtype=dtype)
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=piece.offset + start * row)
        return flat.view(stop - start, *entry.global_shape[1:]) if entry.global_shape else flat.view(())

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor, shaped ``global_shape``: a view when one piece holds it, else consolidated.

        Raises:
            CheckpointIntegrityError: a chunk fails its check, or the file is missing or short.
        """
        piece = self.whole_piece(entry)
        if piece is None:
            return _consolidated(self.ckpt, self.manifest, entry, self.verify)
        rows = entry.global_shape[0] if entry.global_shape else 1
        return self._view(entry, piece, 0, rows).reshape(entry.global_shape)

    def rows(self, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0, shaped ``(stop - start, *global_shape[1:])``.

        Only the bytes of those rows are read (widened to whole chunks when checking), from every
        piece that holds some of them.

        Raises:
            ValueError: a 0-d tensor or rows outside ``[0, global_shape[0]]``.
            CheckpointIntegrityError: a chunk fails its check, or the file is missing or short.
        """
        _check_rows(entry, start, stop)
        piece = self.whole_piece(entry)
        if piece is not None:
            return self._view(entry, piece, start, stop)
        if all(p.flat_range is not None for p in entry.pieces):  # rows of a row-major tensor: one flat range
            cols = math.prod(entry.global_shape[1:])
            where = {"flat_range": (start * cols, stop * cols)}
        else:  # boxes (a tensor-parallel save): read as a box, run by run
            where = {"slices": ((start, stop), *((0, size) for size in entry.global_shape[1:]))}
        spec = ShardSpec(name=entry.full_name, kind=entry.kind, global_shape=entry.global_shape,
                         dtype=entry.torch_dtype, **where)
        out = read_region(self.ckpt, self.manifest, entry, spec, verify=self.verify)
        return out.view(stop - start, *entry.global_shape[1:])

    def tensor_for_rows(self, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
        """A whole-shaped tensor of which only rows ``[start, stop)`` are read and checked.

        For a consumer that slices its rows out of the whole tensor itself (a tensor-parallel rank
        in vLLM). One piece: a view of the mapping, whose other rows are the file's bytes, read
        only if touched and unchecked. Several pieces: a new tensor whose other rows are NaN
        (floating dtypes), so a consumer slicing elsewhere sees NaN rather than plausible values;
        other dtypes are read whole.

        Raises:
            ValueError: a 0-d tensor or rows outside ``[0, global_shape[0]]``.
            CheckpointIntegrityError: a chunk fails its check, or the file is missing or short.
        """
        _check_rows(entry, start, stop)
        piece = self.whole_piece(entry)
        if piece is not None:
            mapped = self._map(piece)
            row = _row_bytes(entry)
            self._check(piece, mapped, start * row, stop * row)
            return torch.frombuffer(mapped, dtype=entry.torch_dtype, count=math.prod(entry.global_shape),
                                    offset=piece.offset).view(entry.global_shape)
        dtype = entry.torch_dtype
        if not dtype.is_floating_point:
            return _consolidated(self.ckpt, self.manifest, entry, self.verify)
        out = torch.full(entry.global_shape, float("nan"), dtype=dtype)
        out[start:stop] = self.rows(entry, start, stop)
        return out


def _row_bytes(entry: TensorEntry) -> int:
    return math.prod(entry.global_shape[1:]) * entry.torch_dtype.itemsize


def _check_rows(entry: TensorEntry, start: int, stop: int) -> None:
    if not entry.global_shape:
        raise ValueError(f"{entry.full_name} is 0-d: it has no rows to read; read it whole.")
    if not 0 <= start <= stop <= entry.global_shape[0]:
        raise ValueError(f"rows [{start}, {stop}) are outside {entry.full_name}'s {entry.global_shape[0]} rows.")


def _consolidated(ckpt: Path, manifest: Manifest, entry: TensorEntry, verify: bool) -> torch.Tensor:
    spec = ShardSpec(name=entry.full_name, kind=entry.kind, global_shape=entry.global_shape,
                     dtype=entry.torch_dtype, flat_range=(0, math.prod(entry.global_shape)))
    return read_region(ckpt, manifest, entry, spec, verify=verify).reshape(entry.global_shape)
