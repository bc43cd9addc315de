"""Saving: every rank writes its own pieces in parallel, the leader commits atomically.

The sequence (README "Why a save never loses a checkpoint" has the reasoning):

1. every rank describes its state; bad input is refused on every rank before anything is written;
2. the leader clears leftovers and creates ``.tmp-step-N/``;
3. every rank writes ``data/rank-R.bin`` (pieces it is the writer of) and ``objects/rank-R.json``
   (``.pt``: a restricted pickle, when a value has no JSON encoding),
   hashing while writing, and fsyncs; all ranks agree on success before going on, so a rank whose
   disk filled up never leaves the others waiting in a collective;
4. the leader gathers the piece records, checks they tile every tensor, writes and fsyncs the
   manifest, renames ``.tmp-step-N`` to ``step-N`` (the commit), moves ``latest``, prunes.

An async save snapshots pieces and objects to CPU memory, then runs steps 3-4 on a background
thread over its own gloo group, so the training loop's collectives never interleave with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.universal_ckpt import directory
from plait.universal_ckpt.adapters import NO_OBJECT, Adapter, adapt
from plait.universal_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
    UnsafeObjectError,
)
from plait.universal_ckpt.exchange import Group, agree, all_gather_objects, broadcast_object
from plait.universal_ckpt.interop.hf import TIED_ALIASES
from plait.universal_ckpt.manifest import (
    HASH_ALGORITHM,
    MANIFEST_NAME,
    Layout,
    Manifest,
    ObjectFile,
    Piece,
    TensorEntry,
    dtype_name,
)
from plait.universal_ckpt.reader import check_coverage
from plait.universal_ckpt.safe_objects import encode_objects
from plait.universal_ckpt.storage import (
    CHECKSUM_ALGORITHM,
    file_digest,
    fsync_dir,
    tensor_bytes,
    write_durable,
    write_pieces,
)

# Fault injection for the reliability tests: called with the name of each phase boundary.
_fault_hook: Callable[[str], None] | None = None


def set_fault_hook(hook: Callable[[str], None] | None) -> None:
    """Install a callable run at each save phase (tests use it to SIGKILL or fail on purpose).

    Phases: ``prepared``, ``data_written``, ``gathered``, ``manifest_written``, ``committed``,
    ``latest_moved``, ``pruned``.
    """
    global _fault_hook
    _fault_hook = hook


def _phase(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


@dataclasses.dataclass
class _LocalPiece:
    full_name: str
    key: str
    name: str
    kind: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    flat_range: tuple[int, int] | None
    slices: tuple[tuple[int, int], ...] | None
    data: torch.Tensor
    pattern: dict | None = None


@dataclasses.dataclass
class _Plan:
    root: Path
    step: int
    group: Group
    pieces: list[_LocalPiece]
    objects: tuple[bytes, str] | None  # (file bytes, encoding)
    object_keys: tuple[str, ...]
    layout: Layout
    keep_last: int | None
    chunk_bytes: int
    user_meta: dict
    allow_pickle: bool = False


def _describe(adapters: list[Adapter], group: Group, *, snapshot: bool,
              allow_pickle: bool) -> tuple[list[_LocalPiece], tuple[bytes, str] | None, tuple[str, ...]]:
    pieces = []
    for adapter in adapters:
        gather = partial(all_gather_objects, group=group)
        for _, sharded in sorted(adapter.tensors_for_save(gather).items()):
            # The tensor is spec.name: a rank holding several pieces of one tensor keys them
            # piece_key(name, i) (the sharded-state protocol), so the dict key is not the name.
            spec = sharded.spec
            name = spec.name
            if spec.writer_rank != group.rank:
                continue
            data = sharded.local.detach()
            if snapshot or data.device.type != "cpu":
                data = data.to("cpu", copy=True)
            pieces.append(_LocalPiece(f"{adapter.key}/{name}", adapter.key, name, spec.kind, spec.global_shape,
                                      spec.dtype, spec.flat_range, spec.slices, data, spec.pattern))
    objects = {a.key: obj for a in adapters if (obj := a.object_for_save()) is not NO_OBJECT}
    data, refused = None, None
    try:  # serialised now: the snapshot of non-tensor state
        data = encode_objects(objects, allow_pickle=allow_pickle) if objects else None
    except UnsafeObjectError as exc:
        refused = exc
    # every rank learns of a refusal before any file is written (one rank alone must not stop)
    verdicts = all_gather_objects(None if refused is None else str(refused), group)
    if refused is not None:
        raise refused
    for rank, message in enumerate(verdicts):
        if message is not None:
            raise UnsafeObjectError(f"rank {rank}: {message}", key_path="<other rank>", type_name="<other rank>")
    return pieces, data, tuple(sorted(objects))


def _rank_file(kind: str, rank: int, encoding: str = "pickle") -> str:
    suffix = "bin" if kind == "data" else "json" if encoding == "json" else "pt"
    return f"{kind}/rank-{rank:05d}.{suffix}"


def _write_rank(plan: _Plan, tmp: Path) -> dict:
    """Write this rank's data and object files; returns the records the leader needs."""
    rank = plan.group.rank
    record: dict[str, Any] = {"rank": rank, "pieces": [], "files": {}, "object": None}
    if plan.pieces:
        rel = _rank_file("data", rank)
        written = write_pieces(tmp / rel, [tensor_bytes(p.data) for p in plan.pieces], chunk_bytes=plan.chunk_bytes)
        for piece, (offset, nbytes, hashes, checksums) in zip(plan.pieces, written):
            record["pieces"].append((piece.full_name, piece.key, piece.name, piece.kind, piece.global_shape,
                                     dtype_name(piece.dtype), Piece(file=rel, offset=offset, nbytes=nbytes,
                                                                    flat_range=piece.flat_range,
                                                                    slices=piece.slices, hashes=hashes,
                                                                    checksums=checksums),
                                     piece.pattern))
        record["files"][rel] = sum(n for _, n, _, _ in written)
    if plan.objects is not None:
        data, encoding = plan.objects
        rel = _rank_file("objects", rank, encoding)
        write_durable(tmp / rel, data)
        record["object"] = ObjectFile(rank=rank, file=rel, nbytes=len(data),
                                      hash=file_digest(tmp / rel, HASH_ALGORITHM), keys=plan.object_keys,
                                      encoding=encoding)
    return record


def _merged_pattern(full: str, patterns: list[dict | None]) -> dict | None:
    """The one pattern every writer of a tensor gave; pipeline stages holding a tied tensor
    (each its own copy) may differ only in ``stages``, which are then listed together."""
    stages = sorted({s for p in patterns if p for s in p.get("stages", ())})
    rest = {json.dumps({k: v for k, v in (p or {}).items() if k != "stages"} if p else None, sort_keys=True)
            for p in patterns}
    if len(rest) > 1:
        raise CheckpointError(f"ranks disagree on the layout pattern of {full}: {sorted(rest)}.")
    return {**(patterns[0] or {}), "stages": stages} if stages else patterns[0]


def _build_manifest(plan: _Plan, records: list[dict]) -> Manifest:
    grouped: dict[str, list] = {}
    for record in records:
        for full, key, name, kind, shape, dtype, piece, pattern in record["pieces"]:
            grouped.setdefault(full, []).append((key, name, kind, tuple(shape), dtype, piece, pattern))
    tensors = {}
    for full, items in grouped.items():
        key, name, kind, shape, dtype = items[0][:5]
        pattern = _merged_pattern(full, [item[6] for item in items])
        if any(item[2:5] != (kind, shape, dtype) for item in items):
            raise CheckpointError(f"ranks disagree on the kind/shape/dtype of {full}: "
                                  f"{sorted({item[2:5] for item in items})}.")
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        numel = 1
        for size in shape:
            numel *= size
        # Pieces with the same coordinates from several ranks are replicas whose producer named
        # each rank as its own writer; the lowest rank's is kept. Their hashes must agree: ranks
        # holding different values under one name (a rank-local expert saved without its global
        # identity) would otherwise lose every rank's values but one, silently.
        unique: dict[tuple, Piece] = {}
        for item in items:
            kept = unique.setdefault((item[5].flat_range, item[5].slices), item[5])
            if kept.hashes != item[5].hashes:
                raise CheckpointError(
                    f"{full}: ranks wrote different values for the same part of it "
                    f"(range {item[5].flat_range or item[5].slices}): it is not replicated, so saving one rank's "
                    f"copy would lose the others'. Give such tensors a global identity (ZeRO's zero_global param-"
                    f"group key, plait.moe_layers.zero_param_groups for experts) or distinct names per rank.")
        entry = TensorEntry(key=key, name=name, kind=kind, global_shape=shape, dtype=dtype,
                            nbytes=numel * itemsize, pieces=tuple(unique.values()), pattern=pattern)
        problem = check_coverage(entry)
        if problem:
            raise CheckpointError(f"the producers' pieces do not tile the tensor: {problem}")
        tensors[full] = entry
    files = {rel: size for record in records for rel, size in record["files"].items()}
    objects = {record["rank"]: record["object"] for record in records if record["object"] is not None}
    has_checksums = any(p.checksums is not None for e in tensors.values() for p in e.pieces)
    return Manifest(step=plan.step, layout=plan.layout, tensors=tensors, objects=objects, files=files,
                    chunk_bytes=plan.chunk_bytes, checksum_algorithm=CHECKSUM_ALGORITHM if has_checksums else None,
                    created_unix=time.time(), user_meta=plan.user_meta,
                    # a JSON file holds no pickle, whatever allow_pickle said
                    pickled_objects=plan.allow_pickle and any(o.encoding == "pickle" for o in objects.values()))


def _raise_agreed(failures: list[tuple[int, str]], what: str, group: Group, own: BaseException | None) -> None:
    if not failures:
        return
    detail = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
    error = CheckpointWriteError(f"{what} failed, nothing was committed ({detail}).")
    raise error from own


def _execute(plan: _Plan) -> Path:
    """Steps 3-4 of the module docstring; runs on the caller's thread or the async thread."""
    group, root = plan.group, plan.root
    tmp = root / directory.tmp_dir_name(plan.step)
    record, error = None, None
    try:
        record = _write_rank(plan, tmp)
        _phase("data_written")
    except Exception as exc:  # noqa: BLE001 - every failure must reach the agreement below
        error = exc
    failures = agree(error, group)
    if failures and group.rank == group.leader:
        directory.clean_leftovers(root)
    _raise_agreed(failures, f"writing checkpoint step {plan.step} to {root}", group, error)
    records = all_gather_objects(record, group)
    _phase("gathered")
    final, error = root / directory.step_dir_name(plan.step), None
    if group.rank == group.leader:
        try:
            manifest = _build_manifest(plan, records)
            for sub in ("data", "objects"):
                if (tmp / sub).is_dir():
                    fsync_dir(tmp / sub)
            write_durable(tmp / MANIFEST_NAME, manifest.to_json().encode())
            _phase("manifest_written")
            directory.commit(root, plan.step)
            _phase("committed")
            directory.point_latest(root, plan.step)
            _phase("latest_moved")
            if plan.keep_last is not None:
                directory.prune(root, plan.keep_last)
                _phase("pruned")
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
            if not final.exists():
                directory.clean_leftovers(root)
    failures = [(group.leader, message) for message in [broadcast_object(
        None if error is None else f"{type(error).__name__}: {error}", group)] if message is not None]
    _raise_agreed(failures, f"committing checkpoint step {plan.step} to {root}", group, error)
    return final


def _prepare(state: dict[str, Any], path: str | os.PathLike, *, step: int, keep_last: int | None,
             group: Any, layout: Layout | dict | None, chunk_bytes: int, user_meta: dict | None,
             snapshot: bool, allow_pickle: bool = False) -> _Plan:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int.")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be a positive int or None (keep all).")
    if chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 4096.")
    g = Group.of(group)
    if layout is None:
        # Producers may describe their own layout (``checkpoint_layout() -> dict``); merged in key order.
        found: dict = {}
        for value in state.values():
            describe = getattr(value, "checkpoint_layout", None)
            if callable(describe):
                found.update(describe())
        layout = found or None
    if isinstance(layout, dict):
        layout = Layout(**{"world_size": g.world_size, **layout})
    layout = layout or Layout(world_size=g.world_size)
    if layout.world_size != g.world_size:
        raise ValueError(f"layout.world_size={layout.world_size} but {g.world_size} ranks are saving; fix the layout.")
    root = Path(path)
    error = None
    if g.rank == g.leader:
        try:
            if (root / MANIFEST_NAME).is_file():
                raise CheckpointExistsError(f"{root} is itself a checkpoint directory; save to a root directory.")
            if (root / directory.step_dir_name(step)).exists():
                raise CheckpointExistsError(f"checkpoint step {step} already exists in {root}; "
                                            "saves never overwrite a committed checkpoint, use another step.")
            root.mkdir(parents=True, exist_ok=True)
            directory.clean_leftovers(root)
            tmp = root / directory.tmp_dir_name(step)
            for sub in ("data", "objects"):
                (tmp / sub).mkdir(parents=True)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
    message = broadcast_object(None if error is None else f"{type(error).__name__}: {error}", g)
    if message is not None:
        if error is not None:
            raise error
        raise CheckpointExistsError(message) if "Exists" in message else CheckpointWriteError(message)
    adapters = adapt(state, g.ranks)
    pieces, objects, keys = _describe(adapters, g, snapshot=snapshot, allow_pickle=allow_pickle)
    _phase("prepared")
    return _Plan(root, step, g, pieces, objects, keys, layout, keep_last, chunk_bytes,
                 _with_tied_aliases(user_meta or {}, adapters), allow_pickle)


def _with_tied_aliases(user_meta: dict, adapters: list[Adapter]) -> dict:
    """``user_meta`` plus the tied names of every producer that reports them (``checkpoint_aliases()``:
    a sharded model holds a tied tensor once), so consolidated exports give every name back."""
    found = {}
    for adapter in adapters:
        report = getattr(getattr(adapter, "producer", None), "checkpoint_aliases", None)
        aliases = report() if callable(report) else None
        if aliases:
            found[adapter.key] = dict(aliases)
    if not found:
        return user_meta
    recorded = user_meta.get(TIED_ALIASES, {})
    merged = {key: {**found.get(key, {}), **recorded.get(key, {})} for key in {*found, *recorded}}
    return {**user_meta, TIED_ALIASES: merged}


class SaveHandle:
    """The result of :func:`save`: already finished for a blocking save, running for an async one.

    Attributes:
        path: the committed checkpoint directory (it exists once :meth:`wait` returns).
        step: the step saved.
    """

    def __init__(self, path: Path, step: int, thread: threading.Thread | None = None) -> None:
        self.path = path
        self.step = step
        self._thread = thread
        self._error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the save is committed.

        Returns:
            The committed checkpoint directory.

        Raises:
            CheckpointWriteError: the background save failed (raised once, here or on the next save).
            TimeoutError: still running after ``timeout`` seconds.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"async save of step {self.step} still running after {timeout}s.")
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error
        return self.path


_async_groups: dict[tuple[int, ...], Any] = {}


def async_group(group: Group) -> Group:
    """A private gloo group over the same ranks, created once (collectively) and reused."""
    if not group.distributed:
        return group
    if group.ranks not in _async_groups:
        # The job's collective timeout, not torch's 30 minutes: a rank dying mid-save fails fast.
        _async_groups[group.ranks] = dist.new_group(ranks=list(group.ranks), backend="gloo",
                                                    timeout=collectives.group_timeout())
    return group.with_handle(_async_groups[group.ranks])


def start(plan: _Plan, *, background: bool) -> SaveHandle:
    """Run a prepared save now, or on a background thread."""
    final = plan.root / directory.step_dir_name(plan.step)
    if not background:
        _execute(plan)
        return SaveHandle(final, plan.step)
    handle = SaveHandle(final, plan.step)

    def run() -> None:
        try:
            _execute(plan)
        except BaseException as exc:  # noqa: BLE001 - kept for the next wait()/save()
            handle._error = exc

    handle._thread = threading.Thread(target=run, name=f"plait-ckpt-save-{plan.step}", daemon=True)
    handle._thread.start()
    return handle
