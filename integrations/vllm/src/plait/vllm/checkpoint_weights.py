"""A plait universal checkpoint as the ``(name, tensor)`` stream vLLM's ``model.load_weights`` takes.

No vLLM import here, so this part is tested without vLLM. Names: the checkpoint stores a model
under one top-level key (``model`` by default); ZeRO producers (plait-zero-sharding) keep its
parameters as ``model.<name>`` and buffers as ``buffer.<name>``, other producers keep the model's
own ``state_dict`` names. Either way the stream carries the HF ``state_dict`` names, which is
what vLLM's ``load_weights`` maps onto its fused layers (qkv, gate|up) and tensor-parallel slices.
A tensor stored as one piece is handed over as a view of the mapped data file (no copy before
vLLM's own copy into its parameter, as with safetensors); a tensor split over several pieces is
consolidated, each piece read straight into its place. Every chunk handed over is checked against
the manifest's fast checksum (XXH3-64; sha256 for checkpoints saved without checksums): iterating
checks each tensor before it is yielded; :meth:`CheckpointWeights.checked_ahead` (what the loader
uses in one process) checks them on a worker thread alongside the consumer's copies when a core
is free, the load failing at its end for a damaged chunk (:mod:`plait.vllm.checked_ahead`);
:meth:`CheckpointWeights.checked_on_copy` (what the loader uses with tensor parallelism) checks
the chunks of a mapped tensor inside vLLM's copy of it, each block hashed right after it is
copied, while it is in cache (:mod:`plait.vllm.checked_copy`). With tensor parallelism, a rank
reads and checks only the rows of dim 0 it keeps of the weights vLLM splits that way
(:mod:`plait.vllm.tensor_parallel`); under ``checked_on_copy`` it reads and checks only the
chunks of the bytes vLLM copies, whatever the split, and owes only the chunks of its rows (dim-0
splits) or of its columns (the row-parallel weights split along dim 1).

One layout differs between a model in memory and its HF checkpoint files: transformers >= 5 keeps
an MoE block's experts fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` with the gate
rows first, ``mlp.experts.down_proj`` ``[E, H, I]``), and its ``save_pretrained`` writes them per
expert under the family's on-disk names, which are what vLLM's weight loaders read. A checkpoint
saved from the module holds the fused form, so it is split here for the families in
:data:`ON_DISK_EXPERTS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from plait.kernels.sharded_state import ShardSpec
from plait.universal_ckpt.directory import resolve
from plait.universal_ckpt.errors import CheckpointIntegrityError, CheckpointLayoutError
from plait.universal_ckpt.interop.hf import ZERO_MARKER, model_name
from plait.universal_ckpt.manifest import Manifest, TensorEntry
from plait.universal_ckpt.mapped import MappedReader
from plait.universal_ckpt.reader import check_files, read_manifest, read_region
from plait.vllm.checked_ahead import AheadCheck, core_free, piece_chunks
from plait.vllm.checked_copy import CheckOnCopy, integrity_error
from plait.vllm.tensor_parallel import TensorParallelRank, rank_cols, rank_rows

WEIGHT_KINDS = ("parameter", "buffer")


@dataclasses.dataclass(frozen=True)
class OnDiskExperts:
    """A family's HF on-disk names for one expert's weights (``<block>.experts.<e>.<gate|up|down>.weight``)."""

    block: str
    gate: str
    up: str
    down: str


ON_DISK_EXPERTS = {"mixtral": OnDiskExperts(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
                   "qwen2_moe": OnDiskExperts(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")}
"""``config.model_type`` -> on-disk expert names, for checkpoints that hold transformers' fused experts."""

_FUSED = re.compile(r"^(?P<prefix>.*)\.mlp\.(?P<rest>experts\.(?P<which>gate_up_proj|down_proj)|gate\.weight)$")


def on_disk_weights(name: str, tensor: torch.Tensor, model_type: str | None) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` in the HF on-disk form: fused experts split per expert, others unchanged.

    Args:
        name: a ``state_dict`` name.
        tensor: its tensor.
        model_type: the HF ``config.model_type`` (None: no renaming).

    Returns:
        One pair, or ``2E`` (gate_up) / ``E`` (down) pairs for a fused expert tensor.

    Raises:
        CheckpointLayoutError: a fused expert tensor of a family without a known on-disk layout.
    """
    match = _FUSED.match(name)
    if match is None or model_type is None:
        return [(name, tensor)]
    layout = ON_DISK_EXPERTS.get(model_type)
    if layout is None:
        if match["which"] is None:  # a router weight of a family that keeps mlp.gate on disk
            return [(name, tensor)]
        raise CheckpointLayoutError(
            f"{name}: fused experts of model_type={model_type!r}, whose on-disk names plait-vllm does not know "
            f"(known: {sorted(ON_DISK_EXPERTS)}); serve an HF export of this checkpoint instead "
            "(save_pretrained / export_hf), or add the family to plait.vllm.checkpoint_weights.ON_DISK_EXPERTS.")
    block = f"{match['prefix']}.{layout.block}"
    if match["which"] is None:
        return [(f"{block}.gate.weight", tensor)]
    if match["which"] == "down_proj":
        return [(f"{block}.experts.{e}.{layout.down}.weight", tensor[e]) for e in range(tensor.shape[0])]
    inter = tensor.shape[1] // 2
    out = []
    for e in range(tensor.shape[0]):
        out.append((f"{block}.experts.{e}.{layout.gate}.weight", tensor[e, :inter]))
        out.append((f"{block}.experts.{e}.{layout.up}.weight", tensor[e, inter:]))
    return out


class CheckpointWeights:
    """The model weights of one universal checkpoint, read lazily.

    Args:
        path: a checkpoint directory (holds ``manifest.json``) or a checkpoint root (its latest
            committed step is used).
        key: the top-level key holding the model (default: the only key holding parameters).
        verify: check every chunk read against the manifest (default True).
        model_type: the HF ``config.model_type``; fused experts of the families in
            :data:`ON_DISK_EXPERTS` are then streamed in their on-disk per-expert form.
        tensor_parallel: the vLLM tensor-parallel rank reading (default: TP=1, whole tensors).
            Tensors split along dim 0 (dim 1: the row-parallel weights) are then whole-shaped with
            only this rank's rows (columns) read and checked; the others are the file's unchecked
            bytes, or NaN where the tensor had to be consolidated from several pieces.

    Raises:
        CheckpointNotFoundError: no plait checkpoint at ``path``.
        CheckpointFormatError: a damaged or newer-format manifest.
        CheckpointIntegrityError: a data file is missing or has the wrong size (names the file).
        CheckpointLayoutError: no key holds parameters, or several do and ``key`` is not given.
    """

    def __init__(self, path: str | os.PathLike, *, key: str | None = None, verify: bool = True,
                 model_type: str | None = None, tensor_parallel: TensorParallelRank | None = None) -> None:
        self.directory: Path = resolve(path)
        self.manifest: Manifest = read_manifest(self.directory)
        check_files(self.directory, self.manifest)  # stat only: a truncated file fails before any read
        self.key = self._pick_key(key)
        self.verify = verify
        self.model_type = model_type
        self.tensor_parallel = tensor_parallel
        self.rows_read: dict[str, tuple[int, int]] = {}  # name -> rows, for the tensors read in part
        self.cols_read: dict[str, tuple[int, int]] = {}  # name -> columns, for consolidated row-parallel tensors
        self.nan_filled: set[str] = set()  # tensors consolidated with NaN outside the rows or columns read
        self.checked_bytes: int | None = None  # after a checked stream: bytes of mapped tensors checked
        self.checked_ahead_worker: bool | None = None  # whether checked_ahead() last ran its worker thread
        self.worker_checked_bytes: int | None = None  # after checked_ahead(): bytes its worker hashed
        self._zero = f"{self.key}/{ZERO_MARKER}" in self.manifest.tensors

    def _pick_key(self, key: str | None) -> str:
        keys = sorted({e.key for e in self.manifest.tensors.values() if e.kind == "parameter"})
        if key is None:
            if len(keys) != 1:
                raise CheckpointLayoutError(
                    f"{self.directory}: parameters live under keys {keys or 'none'}; pass "
                    "model_loader_extra_config={'key': <one of them>} to say which one is the model.")
            return keys[0]
        if key not in keys:
            raise CheckpointLayoutError(f"{self.directory}: key {key!r} holds no parameters; keys with "
                                        f"parameters: {keys}. Fix model_loader_extra_config['key'].")
        return key

    def entries(self) -> list[TensorEntry]:
        """The model's parameter and buffer entries, sorted by name."""
        return sorted((e for e in self.manifest.tensors.values() if e.key == self.key and e.kind in WEIGHT_KINDS),
                      key=lambda e: e.name)

    def name_of(self, entry: TensorEntry) -> str:
        """The model's own ``state_dict`` name of ``entry`` (the ZeRO producer's prefix removed)."""
        return model_name(entry.name, entry.kind, zero=self._zero)

    def rows_for(self, entry: TensorEntry) -> tuple[int, int] | None:
        """The rows of dim 0 this rank reads of ``entry``, or None for all of it."""
        if self.tensor_parallel is None:
            return None
        rows = rank_rows(self.name_of(entry), entry.global_shape, self.tensor_parallel)
        return None if rows == (0, entry.global_shape[0] if entry.global_shape else 0) else rows

    def segments_for(self, entry: TensorEntry) -> list[tuple[int, int]] | None:
        """Byte ranges of a one-piece ``entry`` this rank needs: its rows, or its columns in every
        row (a row-parallel weight split along dim 1); None for all of it."""
        if self.tensor_parallel is None or not entry.global_shape:
            return None
        row = entry.nbytes // entry.global_shape[0]
        rows = self.rows_for(entry)
        if rows is not None:
            return [(rows[0] * row, rows[1] * row)]
        cols = rank_cols(self.name_of(entry), entry.global_shape, self.tensor_parallel)
        if cols is None:
            return None
        item = entry.torch_dtype.itemsize
        return [(r * row + cols[0] * item, r * row + cols[1] * item) for r in range(entry.global_shape[0])]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` one tensor at a time, in the HF on-disk form, each checked first.

        A yielded tensor may be a view of the mapped checkpoint file: copy it (as vLLM's weight
        loaders do), do not write to it.

        Raises:
            CheckpointIntegrityError: a chunk's hash differs from the manifest's. The message names
                the file, the checkpoint directory and the fix.
        """
        return self._stream(None)

    @contextlib.contextmanager
    def checked_on_copy(self) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        """The stream for a consumer that copies what it is given (vLLM's ``load_weights``), checked
        inside those copies.

        A mapped tensor is yielded unchecked, as a :class:`~plait.vllm.checked_copy.MappedView`,
        and the consumer's ``copy_`` of it hashes each block right after copying it, while it is in
        cache (a damaged chunk is zeroed in the destination and raises; any other read of its
        values checks them first). Leaving the block normally checks every chunk still owed; with
        ``verify=False`` this is plain iteration.

            with weights.checked_on_copy() as stream:
                model.load_weights(stream)

        Raises:
            CheckpointIntegrityError: a chunk's hash differs (names the file), inside the block
                where it was read, or when the block ends for a chunk nothing read.
        """
        if not self.verify:
            yield self._stream(None)
            return
        checker = CheckOnCopy(self.directory)
        yield self._stream(checker)
        checker.finish()
        self.checked_bytes = checker.checked_bytes

    @contextlib.contextmanager
    def checked_ahead(self, worker: bool | None = None) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        """The whole-tensor stream (TP=1) with its chunks checked by a worker thread alongside the
        consumer's copies (:mod:`plait.vllm.checked_ahead`): tensors are handed over before they are
        checked, and leaving the block normally checks every chunk the worker has not found good,
        raising for a damaged one (which the consumer may have copied: the load must fail there).
        Without a worker each tensor is checked before it is handed over. With ``verify=False``
        this is plain iteration.

            with weights.checked_ahead() as stream:
                model.load_weights(stream)

        Args:
            worker: start the worker thread; None (default): when a core looks free for it
                (:func:`~plait.vllm.checked_ahead.core_free`). False: each tensor is checked
                before it is handed over, on the consumer's thread.

        Raises:
            ValueError: for a tensor-parallel rank (use :meth:`checked_on_copy`).
            CheckpointIntegrityError: a chunk's hash differs (names the file): at the next tensor
                once the worker has found it, before the tensor is handed over without a worker,
                else when the block ends.
        """
        if self.tensor_parallel is not None:
            raise ValueError(f"checked_ahead() streams whole tensors; rank {self.tensor_parallel.rank} of "
                             f"{self.tensor_parallel.size} reads only its part: use checked_on_copy().")
        if not self.verify:
            yield self._stream(None)
            return
        checked = MappedReader(self.directory, self.manifest, verify=True)  # several pieces: checked as read
        unchecked = MappedReader(self.directory, self.manifest, verify=False)
        entries = self.entries()
        try:
            views = [self._whole_view(unchecked, entry) for entry in entries]
            ahead = AheadCheck(self.directory, [[] if view is None else piece_chunks(
                view, entry, MappedReader.whole_piece(entry), self.manifest) for entry, view in zip(entries, views)],
                worker=core_free() if worker is None else worker)
        except BaseException:
            checked.close()
            unchecked.close()
            raise
        self.checked_ahead_worker = ahead.worker
        try:
            yield self._ahead_stream(entries, views, checked, ahead)
            ahead.finish()
            self.checked_bytes = ahead.checked_bytes
        finally:
            ahead.close()
            self.worker_checked_bytes = ahead.worker_bytes  # after close(): the worker has stopped
            checked.close()
            unchecked.close()

    def _whole_view(self, unchecked: MappedReader, entry: TensorEntry) -> torch.Tensor | None:
        """``entry`` as an unchecked view of the mapping when one piece holds it, else None."""
        if MappedReader.whole_piece(entry) is None:
            return None
        try:
            return unchecked.tensor(entry)
        except CheckpointIntegrityError as exc:
            raise integrity_error(exc, self.directory, entry.full_name) from exc

    def _ahead_stream(self, entries: list[TensorEntry], views: list[torch.Tensor | None], checked: MappedReader,
                      ahead: AheadCheck) -> Iterator[tuple[str, torch.Tensor]]:
        for index, (entry, view) in enumerate(zip(entries, views)):
            ahead.before(index)
            tensor = view
            if tensor is None:
                try:
                    tensor = checked.tensor(entry)
                except CheckpointIntegrityError as exc:
                    raise integrity_error(exc, self.directory, entry.full_name) from exc
            yield from on_disk_weights(self.name_of(entry), tensor, self.model_type)

    def cols_for(self, entry: TensorEntry) -> tuple[int, int] | None:
        """The columns of dim 1 this rank reads of a row-parallel ``entry``, or None for all of it."""
        if self.tensor_parallel is None:
            return None
        return rank_cols(self.name_of(entry), entry.global_shape, self.tensor_parallel)

    def _read(self, entry: TensorEntry, rows: tuple[int, int] | None, checked: MappedReader,
              unchecked: MappedReader, checker: CheckOnCopy | None) -> torch.Tensor:
        piece = MappedReader.whole_piece(entry)
        if checker is not None and piece is not None:
            return checker.track(unchecked.tensor(entry), entry, piece, self.manifest, self.segments_for(entry))
        if rows is not None:
            return checked.tensor_for_rows(entry, *rows)
        cols = self.cols_for(entry)
        if cols is not None and MappedReader.whole_piece(entry) is None and entry.torch_dtype.is_floating_point:
            self.cols_read[self.name_of(entry)] = cols
            return _consolidated_cols(self.directory, self.manifest, entry, cols, self.verify)
        return checked.tensor(entry)

    def _stream(self, checker: CheckOnCopy | None) -> Iterator[tuple[str, torch.Tensor]]:
        if checker is None and self.verify:
            self.checked_bytes = 0  # counts what MappedReader checks of the mapped tensors before they go out
        checked = MappedReader(self.directory, self.manifest, verify=self.verify)
        unchecked = MappedReader(self.directory, self.manifest, verify=False)
        for entry in self.entries():
            rows = self.rows_for(entry)
            try:
                tensor = self._read(entry, rows, checked, unchecked, checker)
            except CheckpointIntegrityError as exc:
                raise integrity_error(exc, self.directory, entry.full_name) from exc
            if checker is None and self.verify and MappedReader.whole_piece(entry) is not None:
                self.checked_bytes += _chunk_span(entry, rows, self.manifest.chunk_bytes)
            if rows is not None:
                self.rows_read[self.name_of(entry)] = rows
            if MappedReader.whole_piece(entry) is None and entry.torch_dtype.is_floating_point and (
                    rows is not None or self.name_of(entry) in self.cols_read):
                self.nan_filled.add(self.name_of(entry))
            yield from on_disk_weights(self.name_of(entry), tensor, self.model_type)
        checked.close()
        unchecked.close()


def _consolidated_cols(directory: Path, manifest: Manifest, entry: TensorEntry, cols: tuple[int, int],
                      verify: bool) -> torch.Tensor:
    """A whole-shaped tensor split over several pieces with only columns ``[start, stop)`` of dim 1 read
    (and checked: only the chunks those columns touch), NaN elsewhere, so a consumer narrowing to
    other columns sees NaN."""
    rows = entry.global_shape[0]
    box = ShardSpec(name=entry.full_name, kind=entry.kind, global_shape=entry.global_shape, dtype=entry.torch_dtype,
                    slices=((0, rows), cols, *((0, size) for size in entry.global_shape[2:])))
    out = torch.full(entry.global_shape, float("nan"), dtype=entry.torch_dtype)
    out[:, cols[0]:cols[1]] = read_region(directory, manifest, entry, box, verify=verify).view(
        rows, cols[1] - cols[0], *entry.global_shape[2:])
    return out


def _chunk_span(entry: TensorEntry, rows: tuple[int, int] | None, chunk_bytes: int) -> int:
    """Bytes of the whole chunks that rows ``[start, stop)`` of a one-piece tensor (all of it: None) span."""
    if rows is None:
        return entry.nbytes
    row = entry.nbytes // entry.global_shape[0]
    start, stop = rows[0] * row, rows[1] * row
    if stop <= start:
        return 0
    return min(entry.nbytes, -(-stop // chunk_bytes) * chunk_bytes) - start // chunk_bytes * chunk_bytes
