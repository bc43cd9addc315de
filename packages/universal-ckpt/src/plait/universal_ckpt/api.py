"""The public entry points: save, load, latest, and CheckpointManager."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from plait.universal_ckpt import directory, saver
from plait.universal_ckpt.adapters import NO_OBJECT, adapt
from plait.universal_ckpt.errors import CheckpointError, CheckpointLayoutError, SaveInFlightError
from plait.universal_ckpt.exchange import Group, agree
from plait.universal_ckpt.manifest import DEFAULT_CHUNK_BYTES, Layout, Manifest
from plait.universal_ckpt.reader import check_files, read_manifest, read_objects, read_region

_in_flight: saver.SaveHandle | None = None
READ_THREADS = 2


def wait_pending() -> Path | None:
    """Wait for this process's in-flight async save, raising its error if it failed.

    Returns:
        The committed directory of that save, or None when none was pending.
    """
    global _in_flight
    handle, _in_flight = _in_flight, None
    return None if handle is None else handle.wait()


def save(state: dict[str, Any], path: str | os.PathLike, *, step: int, keep_last: int | None = None,
         async_: bool = False, if_busy: str = "wait", group: Any | None = None,
         layout: Layout | dict | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         user_meta: dict | None = None, allow_pickle: bool = False) -> saver.SaveHandle:
    """Save ``state`` as checkpoint ``step`` under the root ``path``; every rank of ``group`` calls it.

    Args:
        state: key -> value. ShardedStateful producers, ``nn.Module`` (DDP too), optimizers and
            tensors are saved as tensors; objects with ``state_dict``/``load_state_dict`` (LR
            scheduler, loss scaler, :class:`RNGState`, a data loader) and plain values are pickled
            per rank.
        path: the checkpoint root; the checkpoint lands in ``path/step-<step>/``.
        step: the training step (names the directory; must be new in this root).
        keep_last: keep only the newest N committed checkpoints (None keeps all).
        async_: snapshot to CPU memory now, write in the background; call ``handle.wait()``
            (or the next save waits). One async save is in flight at a time.
        if_busy: what a save does while an async save is still running: ``"wait"`` or ``"raise"``.
        group: process group (None: the default group, or a single process).
        layout: the producer's layout for the manifest (world size is filled in); by default
            merged from values offering ``checkpoint_layout() -> dict``.
        chunk_bytes: hash chunk size (smaller lets resharded loads read less extra).
        user_meta: JSON-able dict stored in the manifest.
        allow_pickle: store non-tensor values outside the safe-type allowlist anyway (pickled).
            The manifest records it, and loading such a checkpoint needs
            ``load(..., trust_pickled_objects=True)``. Off by default: a value the restricted
            reader could not read back is refused before anything is written.

    Returns:
        A :class:`SaveHandle`; for a blocking save it is already committed.

    Raises:
        CheckpointWriteError: any rank failed to write or commit (disk full, I/O error).
        CheckpointExistsError: ``step`` is already committed in ``path``.
        SaveInFlightError: ``if_busy="raise"`` and an async save is running.
        UnsafeObjectError: a non-tensor value is outside the safe-type allowlist (names its key
            path and type) and ``allow_pickle`` is False; nothing was written.
        ValueError: bad arguments (refused before anything is written).
    """
    global _in_flight
    if if_busy not in ("wait", "raise"):
        raise ValueError(f"if_busy={if_busy!r} must be 'wait' or 'raise'.")
    if _in_flight is not None:
        if if_busy == "raise" and not _in_flight.done():
            raise SaveInFlightError(f"async save of step {_in_flight.step} is still running; "
                                    "wait for it (handle.wait()) or pass if_busy='wait'.")
        wait_pending()
    plan = saver._prepare(state, path, step=step, keep_last=keep_last, group=group, layout=layout,
                          chunk_bytes=chunk_bytes, user_meta=user_meta, snapshot=async_,
                          allow_pickle=allow_pickle)
    if async_:
        plan.group = saver.async_group(plan.group)
        _in_flight = saver.start(plan, background=True)
        return _in_flight
    return saver.start(plan, background=False)


def latest(path: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint under the root ``path`` (via its ``latest`` pointer), or None."""
    return directory.latest(path)


def load(state: dict[str, Any], path: str | os.PathLike, *, verify: bool = True, group: Any | None = None,
         strict: bool = True, trust_pickled_objects: bool = False) -> Manifest:
    """Load a checkpoint into ``state`` in place, resharding to the current layout.

    Each rank reads only the byte ranges its own pieces need (widened to hash chunks when
    verifying). Everything is read and checked into staging memory first and all ranks agree
    before any live tensor is touched, so a refused load leaves the state as it was.

    Args:
        state: the same keys as at save time, holding the *target* objects.
        path: a checkpoint directory, or a root (its latest checkpoint is loaded).
        verify: check every hash read (default). ``verify=False`` skips hashing (faster, and
            sizes are still checked); use it only for checkpoints you have verified otherwise.
        group: process group (None: the default group, or a single process).
        strict: every key of ``state`` must be in the checkpoint, and every tensor its target
            holds. ``strict=False`` leaves missing keys, and a target's bookkeeping tensors (kind
            ``other``, e.g. plait ZeRO's loss scaler) the checkpoint lacks, as they are: a torch
            tensor- or pipeline-parallel checkpoint has no loss scaler to give a ZeRO run. Missing
            parameters and optimizer state are refused either way.
        trust_pickled_objects: read the object files with an unrestricted unpickler. Needed only
            for a checkpoint saved with ``allow_pickle=True``; it can run code from the file, so
            pass it only for checkpoints you trust. By default object files are read with a
            restricted unpickler limited to plain values, tensors and the safe-type allowlist.

    Returns:
        The checkpoint's manifest (step, layout, user_meta).

    Raises:
        CheckpointNotFoundError: no checkpoint at ``path``.
        CheckpointFormatError: foreign, damaged or newer-format manifest.
        CheckpointIntegrityError: a file's hash or size differs (names file, expected, actual).
        CheckpointLayoutError: the target state cannot hold the checkpoint (a weight-only quantized
            checkpoint into full-precision weights included: the message names the scheme and the fix).
        UnsafeObjectError: an object file needs ``trust_pickled_objects=True``.
    """
    ckpt = directory.resolve(path)
    manifest = read_manifest(ckpt)
    check_files(ckpt, manifest)
    g = Group.of(group)
    adapters = adapt(state, g.ranks)
    plans, problems = [], []
    for adapter in adapters:
        saved = manifest.entries_for(adapter.key)
        has_object = any(adapter.key in obj.keys for obj in manifest.objects.values())
        if strict and not saved and not has_object:
            problems.append(f"key {adapter.key!r} is not in the checkpoint (it has {manifest.keys})")
            continue
        targets = adapter.tensors_for_load(saved)
        if "quantization" in manifest.user_meta:  # weights stored as codes: refuse them as full precision
            from plait.universal_ckpt.quantize import refuse_unquantized

            wanted = {t.spec.name for t in targets.values()}
            refuse_unquantized(manifest, adapter.key, wanted | {n.removeprefix("model.") for n in wanted}, "load")
        if not strict:  # bookkeeping the checkpoint's producer did not have keeps the target's value
            targets = {key: target for key, target in targets.items()
                       if target.spec.kind != "other" or target.spec.name in saved}
        for target in targets.values():
            name = target.spec.name  # several pieces of one tensor share it (piece_key)
            entry = saved.get(name)
            if entry is None:
                fix = " (bookkeeping: load with strict=False to keep the target's own)" if target.spec.kind == "other" \
                    else ""
                problems.append(f"{adapter.key}/{name} is not in the checkpoint{fix}")
            elif entry.global_shape != target.spec.global_shape or entry.torch_dtype != target.spec.dtype:
                problems.append(f"{adapter.key}/{name}: checkpoint has {entry.dtype}{list(entry.global_shape)}, "
                                f"target wants {target.spec.dtype}{list(target.spec.global_shape)}")
        plans.append((adapter, targets))
    if problems:
        raise CheckpointLayoutError(f"the target cannot hold checkpoint {ckpt}: " + "; ".join(problems[:20])
                                    + (f"; and {len(problems) - 20} more" if len(problems) > 20 else ""))
    staged, objects, error = {}, {}, None
    try:
        objects = read_objects(ckpt, manifest, g.rank, verify=verify, trusted=trust_pickled_objects)
        jobs = {(adapter.key, name): (manifest.tensors[f"{adapter.key}/{target.spec.name}"], target.spec)
                for adapter, targets in plans for name, target in targets.items()}
        # File reads and hashlib both release the GIL, so two threads overlap reading and hashing.
        with concurrent.futures.ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            futures = {job: pool.submit(read_region, ckpt, manifest, entry, spec, verify=verify)
                       for job, (entry, spec) in jobs.items()}
            staged = {job: future.result() for job, future in futures.items()}
    except Exception as exc:  # noqa: BLE001 - every failure must reach the agreement below
        error = exc
    failures = agree(error, g) if g.distributed else []
    if error is not None:
        raise error
    if failures:
        raise CheckpointError(f"load of {ckpt} refused on other ranks: " + "; ".join(f"rank {r}: {m}"
                                                                                      for r, m in failures))
    with torch.no_grad():
        for adapter, targets in plans:
            for name, target in targets.items():
                staged_piece = staged[(adapter.key, name)].reshape(target.local.shape)
                target.local.copy_(staged_piece)
            adapter.finish_load(targets, objects.get(adapter.key, NO_OBJECT))
    return manifest


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Settings of a :class:`CheckpointManager`.

    Attributes:
        root: the checkpoint root directory.
        keep_last: newest committed checkpoints to keep (None: all).
        async_save: save in the background by default.
        verify_on_load: check hashes on load (the default; False skips hashing).
        if_busy: ``"wait"`` or ``"raise"`` when a save starts while an async one runs.
    """

    root: str | os.PathLike
    keep_last: int | None = 3
    async_save: bool = False
    verify_on_load: bool = True
    if_busy: str = "wait"

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ValueError(f"CheckpointConfig.keep_last={self.keep_last!r} must be a positive int or None.")
        if self.if_busy not in ("wait", "raise"):
            raise ValueError(f"CheckpointConfig.if_busy={self.if_busy!r} must be 'wait' or 'raise'.")


class CheckpointManager:
    """Periodic checkpoints of one training run: save, resume from the latest, keep the last N.

    Args:
        config: the settings.
        group: the process group of the run.
    """

    def __init__(self, config: CheckpointConfig, *, group: Any | None = None) -> None:
        self.config = config
        self.group = group

    def save(self, state: dict[str, Any], *, step: int, **kwargs: Any) -> saver.SaveHandle:
        """Save ``state`` as ``step`` with the manager's settings (kwargs override them)."""
        options = {"keep_last": self.config.keep_last, "async_": self.config.async_save,
                   "if_busy": self.config.if_busy, "group": self.group, **kwargs}
        return save(state, self.config.root, step=step, **options)

    def latest(self) -> Path | None:
        """The newest committed checkpoint, or None."""
        return latest(self.config.root)

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the latest checkpoint into ``state`` if there is one.

        Returns:
            The restored step, or None when the root holds no checkpoint (a fresh start).
        """
        wait_pending()
        if self.latest() is None:
            return None
        return load(state, self.config.root, verify=self.config.verify_on_load, group=self.group).step

    def wait(self) -> Path | None:
        """Wait for the in-flight async save; raises its error if it failed."""
        return wait_pending()
