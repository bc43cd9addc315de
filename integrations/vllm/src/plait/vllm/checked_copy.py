"""Checking a mapped checkpoint tensor's chunks inside the copy vLLM makes of it: one pass over the bytes.

vLLM's ``load_weights`` copies every tensor it is given into a parameter (``param.data.copy_``,
after narrowing it to the rank's part). Checking a tensor's checksums before handing it over reads
its bytes from memory once for the check and again for that copy. Here a tensor stored as one
piece is handed over unchecked, as a :class:`MappedView` (a tensor subclass) of the mapped data
file, registered with the load's :class:`CheckOnCopy`. A ``copy_`` from such a view (contiguous,
same shape) copies it in blocks of :data:`BLOCK_BYTES` and feeds each block to its chunk's
streaming hash right after copying it, while the block is still in the core's cache: the bytes come
from memory once, and the hash runs at cache speed. When a chunk's checksum differs, the bytes
copied from it are zeroed before the copy raises, so no damaged value stays in the destination.
Only the chunks the copied elements touch are read and checked: a tensor-parallel rank that copies
only its rows, or only its columns of a row-parallel weight (where a row's part spans whole
chunks), touches only those.

Any other use that reads the values (anything but taking views and metadata) checks the chunks the
view touches: an in-place op on the view before it runs, anything else before its result is
returned. :meth:`CheckOnCopy.finish` checks the chunks that nothing copied, so every byte a load
was owed is checked before start-up goes on, and a damaged chunk stops it with a
:class:`~plait.universal_ckpt.CheckpointIntegrityError` naming the file. Only ops that involve the
view pay for this (a subclass, not a torch function mode, which would intercept every op).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
from pathlib import Path

import torch

from plait.universal_ckpt import storage
from plait.universal_ckpt.errors import CheckpointIntegrityError
from plait.universal_ckpt.manifest import Manifest, Piece, TensorEntry
from plait.universal_ckpt.storage import check_chunks, pick_digests

BLOCK_BYTES = 256 << 10
"""Copy-then-hash block: small enough to stay in a core's L2 cache between its copy and its hash."""

METADATA = frozenset({
    "shape", "size", "dim", "ndim", "ndimension", "dtype", "device", "stride", "numel", "nelement",
    "element_size", "itemsize", "nbytes", "is_contiguous", "data_ptr", "storage_offset", "untyped_storage",
    "requires_grad", "is_floating_point", "is_complex", "is_signed", "layout", "is_cpu", "is_cuda", "is_meta",
    "is_sparse", "is_quantized", "is_leaf", "grad", "grad_fn", "names", "__len__", "get_device", "is_pinned",
})
"""Tensor attributes and methods that read no values: using them on a tracked view checks nothing."""


def integrity_error(exc: CheckpointIntegrityError, directory: Path, tensor: str) -> CheckpointIntegrityError:
    """The loader's error for a damaged chunk: names the file, the checkpoint, the tensor and the fix."""
    return CheckpointIntegrityError(
        f"plait_universal: checkpoint file {exc.file} in {directory} is corrupt ({exc}); while reading {tensor}. "
        "Restore the file from a good copy or re-save the checkpoint.",
        file=exc.file, expected=exc.expected, actual=exc.actual)


def byte_chunks(segments: list[tuple[int, int]], chunk_bytes: int) -> list[int]:
    """The sorted chunk indices that byte ranges ``[start, stop)`` touch (empty ranges touch none)."""
    touched: set[int] = set()
    for start, stop in segments:
        if stop > start:
            touched.update(range(start // chunk_bytes, -(-stop // chunk_bytes)))
    return sorted(touched)


def view_segments(tensor: torch.Tensor, start: int) -> list[tuple[int, int]]:
    """Byte ranges, relative to address ``start``, that the elements of a strided view occupy.

    A 2-D view whose last dim is dense but whose rows are apart (a weight narrowed along dim 1)
    gives one range per row; any other view gives the one range from its first to its last element.
    """
    offset = tensor.data_ptr() - start
    if tensor.numel() == 0:
        return []
    item = tensor.element_size()
    if tensor.dim() == 2 and tensor.stride(1) == 1 and tensor.stride(0) > tensor.shape[1]:
        width, step = tensor.shape[1] * item, tensor.stride(0) * item
        return [(offset + r * step, offset + r * step + width) for r in range(tensor.shape[0])]
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return [(offset, offset + (last + 1) * item)]


def _hasher(algorithm: str):
    """A streaming hash object of ``algorithm`` (XXH3-64 or a hashlib name): ``update``/``hexdigest``."""
    return storage.xxhash.xxh3_64() if algorithm == storage.CHECKSUM_ALGORITHM else hashlib.new(algorithm)


@dataclasses.dataclass(eq=False)
class _Tracked:
    """One piece handed over unchecked: its bytes, digests, and the chunks still unchecked."""

    owner: CheckOnCopy
    tensor_name: str
    piece: Piece
    digests: tuple[str, ...]
    algorithm: str
    chunk_bytes: int
    base: torch.Tensor  # the whole piece, flat, in its dtype: a view of the mapping
    data: memoryview  # the same bytes
    unchecked: set[int]  # chunk indices not checked yet
    owed: list[int]  # the chunks the load must have checked when it ends

    @property
    def address(self) -> int:
        """Where the piece starts in memory."""
        return self.base.data_ptr()

    def chunks_of(self, start: int, stop: int) -> range:
        """The chunk indices that bytes ``[start, stop)`` of the piece fall in."""
        if stop <= start:
            return range(0)
        return range(start // self.chunk_bytes, -(-stop // self.chunk_bytes))

    def check(self, chunks: range) -> None:
        """Check those of ``chunks`` not checked yet (counted in the owner's ``checked_bytes``).

        Raises:
            CheckpointIntegrityError: a chunk's checksum differs (names the file).
        """
        for index in chunks:
            if index not in self.unchecked:
                continue
            lo, hi = index * self.chunk_bytes, min(self.piece.nbytes, (index + 1) * self.chunk_bytes)
            try:
                check_chunks(self.data[lo:hi], self.piece.file, self.piece.offset, self.piece.nbytes, lo, hi,
                             digests=self.digests, chunk_bytes=self.chunk_bytes, algorithm=self.algorithm)
            except CheckpointIntegrityError as exc:
                raise integrity_error(exc, self.owner.directory, self.tensor_name) from exc
            self.unchecked.discard(index)
            self.owner.checked_bytes += hi - lo

    def check_view(self, tensor: torch.Tensor) -> None:
        """Check the chunks whose bytes ``tensor`` (a view of this piece) touches."""
        self.check(byte_chunks(view_segments(tensor, self.address), self.chunk_bytes))

    def copy_checked_chunk(self, index: int, dst: torch.Tensor) -> None:
        """Copy all of chunk ``index`` into ``dst`` (its elements, flat), hashing each block right
        after copying it; a chunk whose checksum differs is zeroed in ``dst`` and raises.

        Raises:
            CheckpointIntegrityError: the chunk's checksum differs (names the file and the tensor).
        """
        lo, hi = index * self.chunk_bytes, min(self.piece.nbytes, (index + 1) * self.chunk_bytes)
        hasher = _hasher(self.algorithm)
        item = self.base.element_size()
        same = dst.dtype == self.base.dtype
        into, source = dst.data_ptr() - lo, self.address
        for start in range(lo, hi, BLOCK_BYTES):
            stop = min(hi, start + BLOCK_BYTES)
            if same:  # a plain byte copy: far less per call than torch's slicing and dispatch
                ctypes.memmove(into + start, source + start, stop - start)
            else:
                dst[(start - lo) // item:(stop - lo) // item].copy_(self.base[start // item:stop // item])
            hasher.update(self.data[start:stop])  # the block just copied: read again from cache
        if hasher.hexdigest() != self.digests[index]:
            dst.zero_()
            self.check((index,))  # recomputes it and raises the checkpoint's error naming the file
        self.unchecked.discard(index)
        self.owner.checked_bytes += hi - lo


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a tensor property: name it after the attribute
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class MappedView(torch.Tensor):
    """A view of a mapped checkpoint piece whose chunks are not all checked yet (a torch.Tensor subclass).

    Its ``__torch_function__`` checks chunks as the values are used (module docstring): ``copy_``
    from it copies chunk by chunk, each checked just before it is copied; a view of it is again a
    :class:`MappedView`; metadata reads nothing; any other use checks the chunks the view spans
    (in-place ops before they run). Once every chunk of its piece is checked, its ops return plain
    tensors.
    """

    _plait_tracked: _Tracked

    @staticmethod
    def wrap(tensor: torch.Tensor, tracked: _Tracked) -> MappedView:
        """``tensor`` (a view of ``tracked``'s piece) as a :class:`MappedView`."""
        view = tensor.as_subclass(MappedView)
        view._plait_tracked = tracked
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [(t, t._plait_tracked) for t in _tensors(args, kwargs)
                  if isinstance(t, MappedView) and t._plait_tracked.unchecked]
        name = _func_name(func) if inputs else ""
        with torch._C.DisableTorchFunctionSubclass():
            if not inputs or name in METADATA:
                return func(*args, **kwargs)
            if name == "copy_" and len(args) >= 2 and not isinstance(args[0], MappedView):
                source = args[1]
                if isinstance(source, MappedView) and _fits(args[0], source, source._plait_tracked):
                    return _copy_checked(args[0], source, source._plait_tracked, kwargs.get("non_blocking", False))
            if name.endswith("_") and name != "requires_grad_":  # in place: only on checked bytes
                for tensor, tracked in inputs:
                    tracked.check_view(tensor)
                return func(*args, **kwargs)
            result = func(*args, **kwargs)
        tracked = inputs[0][1]
        if isinstance(result, torch.Tensor) and result.device.type == "cpu" and tracked.unchecked and (
                result.untyped_storage().data_ptr() == tracked.address):
            return MappedView.wrap(result, tracked)  # a view: still unchecked, checked when its values are used
        for tensor, tracked in inputs:  # the values were read: check them before the result is seen
            tracked.check_view(tensor)
        return result


def _tensors(args, kwargs) -> list:
    """A call's arguments, top level and inside a list or tuple."""
    out = []
    for value in (*args, *kwargs.values()):
        out.extend(value if isinstance(value, (list, tuple)) else (value,))
    return out


def _fits(dst: torch.Tensor, src: torch.Tensor, tracked: _Tracked) -> bool:
    return (dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
            and src.dtype == tracked.base.dtype and tracked.chunk_bytes % src.element_size() == 0)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, tracked: _Tracked, non_blocking: bool) -> torch.Tensor:
    """``dst.copy_(src)`` chunk by chunk: a whole unchecked chunk copied to CPU memory is hashed block
    by block as it is copied; any other chunk (covered in part, already checked, or copied to
    another device) is checked first, then copied."""
    item = src.element_size()
    first = (src.data_ptr() - tracked.address) // item
    stop = first + src.numel()
    per = tracked.chunk_bytes // item
    flat = dst.view(-1)
    for index in tracked.chunks_of(first * item, stop * item):
        lo, hi = max(index * per, first), min((index + 1) * per, stop)
        whole = lo == index * per and hi * item == min(tracked.piece.nbytes, (index + 1) * tracked.chunk_bytes)
        if whole and index in tracked.unchecked and dst.device.type == "cpu":  # to a GPU: one H2D copy per chunk
            tracked.copy_checked_chunk(index, flat[lo - first:hi - first])
            continue
        tracked.check((index,))
        flat[lo - first:hi - first].copy_(tracked.base[lo:hi], non_blocking=non_blocking)
    return dst


class CheckOnCopy:
    """The pieces one load hands over unchecked, and the check of what they still owe at its end.

    Args:
        directory: the checkpoint directory (for error messages).

    Attributes:
        checked_bytes: bytes checked so far (each was read once for it).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.checked_bytes = 0
        self._tracked: list[_Tracked] = []

    def track(self, tensor: torch.Tensor, entry: TensorEntry, piece: Piece, manifest: Manifest,
              segments: list[tuple[int, int]] | None = None) -> MappedView:
        """``tensor`` (a whole-piece view of the mapping) as an unchecked :class:`MappedView`.

        Args:
            tensor: the view, shaped ``entry.global_shape``.
            entry: its manifest entry.
            piece: the one piece that holds it.
            manifest: the manifest (chunk size and hash algorithm).
            segments: the byte ranges of the piece that the consumer needs (a tensor-parallel
                rank's rows, or its columns in every row); only their chunks are owed at
                :meth:`finish`. None: every chunk is.
        """
        digests, algorithm = pick_digests(piece.hashes, piece.checksums, manifest.hash_algorithm)
        base = tensor.reshape(-1)
        owed = byte_chunks([(0, piece.nbytes)] if segments is None else segments, manifest.chunk_bytes)
        tracked = _Tracked(self, entry.full_name, piece, digests, algorithm, manifest.chunk_bytes, base,
                           memoryview(base.view(torch.uint8).numpy()).cast("B"), set(range(len(digests))), owed)
        self._tracked.append(tracked)
        return MappedView.wrap(tensor, tracked)

    def finish(self) -> None:
        """Check every owed chunk that nothing has checked yet, then let go of the pieces.

        Raises:
            CheckpointIntegrityError: a chunk's checksum differs (names the file).
        """
        for tracked in self._tracked:
            tracked.check(tracked.owed)
        self._tracked.clear()
