"""The file (NVMe) state store: one file per group, a few aligned slots in memory.

Memory holds ``slots`` buffers, each big enough for the largest group. With the default of
three, the protocol of :mod:`plait.offload_io.store` keeps one slot being read (the next group),
one borrowed (the group stepping) and one being written back (the previous group): the double
buffering of ZeRO-Infinity. A slot whose write-back finished keeps its group as a clean cache
entry until the slot is needed again.

A failed write-back (disk full) keeps its slot and its data: the group is never lost, ``get``
still returns it, and :meth:`FileStateStore.flush` writes it again once space is back.
``put`` never raises for a write-back: failures are collected and raised by ``flush``, so a
caller can finish the round (every group stepped) before it learns the state is not durable.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import shutil
import uuid
from collections.abc import Hashable, Iterator, Mapping

import torch

from plait.offload_io import probe
from plait.offload_io.buffers import aligned_empty
from plait.offload_io.engine import AsyncIOEngine, IOHandle
from plait.offload_io.errors import OffloadIOError
from plait.offload_io.store import GroupLayout, StateStore, _check_cpu

FREE, READING, RESIDENT, BORROWED, WRITING, FAILED = "free", "reading", "resident", "borrowed", "writing", "failed"


@dataclasses.dataclass(eq=False)
class _Slot:
    buffer: torch.Tensor
    group_id: Hashable | None = None
    state: str = FREE
    handle: IOHandle | None = None
    last_use: int = 0


def discard_directory(engine: AsyncIOEngine, directory: str, *, remove: bool = True) -> None:
    """Closing an offload directory: let ``engine``'s in-flight I/O finish (its errors no longer
    matter, the files are going away), then delete ``directory`` when ``remove``."""
    try:
        engine.wait()
    except OffloadIOError:
        pass
    if remove:
        shutil.rmtree(directory, ignore_errors=True)


class FileStateStore(StateStore):
    """Groups in files under ``directory``; ``slots`` of them in memory at a time.

    Args:
        directory: where to put the files; a fresh ``plait-state-*`` subdirectory is created in it.
        engine: the I/O engine to use (default: a new one with default :class:`IOConfig`).
        slots: groups held in memory at once; at least 2, 3 gives full double buffering.
        keep_files: leave the files behind on :meth:`close` (for inspection).
        close_engine: close ``engine`` on :meth:`close` (default: only an engine it created).

    Raises:
        ValueError: ``slots < 2``.
        OffloadIOError: ``directory`` cannot be created or written.
    """

    def __init__(self, directory: str | os.PathLike, *, engine: AsyncIOEngine | None = None, slots: int = 3,
                 keep_files: bool = False, close_engine: bool | None = None) -> None:
        if not isinstance(slots, int) or slots < 2:
            raise ValueError(f"FileStateStore: slots={slots!r} must be an int >= 2 (3 overlaps read, step and "
                             "write-back).")
        parent = probe.ensure_directory(os.fspath(directory))
        self.directory = os.path.join(parent, f"plait-state-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.directory)
        self._own_engine = engine is None if close_engine is None else close_engine
        self.engine = engine or AsyncIOEngine()
        self.alignment = self.engine.config.alignment
        self.slots_wanted = slots
        self.keep_files = keep_files
        self._slots: list[_Slot] = []
        self._layouts: dict[Hashable, GroupLayout] = {}
        self._files: dict[Hashable, str] = {}
        self._on_disk: set[Hashable] = set()
        self._errors: list[OffloadIOError] = []
        self._clock = itertools.count(1)
        self._closed = False

    # -- protocol ----------------------------------------------------------------------------
    def register(self, group_id: Hashable, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            _check_cpu(group_id, name, tensor)
        layout = GroupLayout.of(tensors, self.alignment)
        slot = self._find(group_id)
        if slot is not None and slot.state == BORROWED:
            raise ValueError(f"group {group_id!r} is borrowed (get without put); put it back before register.")
        path = self._files.get(group_id) or os.path.join(self.directory, f"group-{len(self._files)}.bin")
        # Checked before anything changes: on failure the caller still holds the only copy.
        probe.check_space(path, layout.nbytes - probe.file_size(path),
                          min_free_bytes=self.engine.config.min_free_bytes,
                          what=f"optimizer state of group {group_id!r}")
        self._files[group_id] = path
        if slot is not None:
            self._settle(slot, record=True)
            # The new values may view the old slot (state updated in place, plus a new entry); the
            # slot can be handed out again below, so take them out of it first.
            storage = slot.buffer.untyped_storage().data_ptr()
            tensors = {k: t.clone() if t.untyped_storage().data_ptr() == storage else t for k, t in tensors.items()}
            self._release(slot)
        self._layouts[group_id] = layout
        self._on_disk.discard(group_id)
        slot = self._take_slot(layout.nbytes)
        for name, view in layout.views(slot.buffer).items():
            view.copy_(tensors[name])
        slot.group_id, slot.state = group_id, BORROWED
        self.put(group_id)

    def prefetch(self, group_id: Hashable) -> None:
        if group_id not in self._layouts:
            raise KeyError(f"group {group_id!r} was never registered with this store.")
        if self._find(group_id) is not None:
            return
        layout = self._layouts[group_id]
        slot = self._take_slot(layout.nbytes)
        slot.group_id, slot.state, slot.last_use = group_id, READING, next(self._clock)
        try:
            slot.handle = self.engine.read_into(slot.buffer[:layout.nbytes], self._files[group_id])
        except BaseException:
            self._release(slot)
            raise

    def get(self, group_id: Hashable) -> dict[str, torch.Tensor]:
        self.prefetch(group_id)
        slot = self._find(group_id)
        assert slot is not None
        if slot.state == BORROWED:
            raise ValueError(f"group {group_id!r} is already borrowed; put it back before getting it again.")
        if slot.state == READING:
            try:
                slot.handle.wait()
            except BaseException:
                self._release(slot)
                raise
            slot.state = RESIDENT
        elif slot.state == WRITING:
            # The write reads the slot's memory; the caller may not modify it until that is done.
            self._settle(slot, record=True)
        slot.state, slot.last_use = BORROWED, next(self._clock)
        return self._layouts[group_id].views(slot.buffer)

    def put(self, group_id: Hashable, *, dirty: bool = True) -> None:
        slot = self._find(group_id)
        if slot is None or slot.state != BORROWED:
            raise ValueError(f"put({group_id!r}) without a matching get().")
        slot.last_use = next(self._clock)
        if not dirty and group_id in self._on_disk:
            slot.state = RESIDENT
            return
        self._start_write(slot)

    def flush(self) -> None:
        for slot in self._slots:
            if slot.state == FAILED:
                self._start_write(slot)
        for slot in self._slots:
            self._settle(slot, record=True)
        failed = [s for s in self._slots if s.state == FAILED]
        errors, self._errors = self._errors, []
        if failed:
            raise errors[-1] if errors else OffloadIOError(
                errno.EIO, f"{len(failed)} groups could not be written to {self.directory}", path=self.directory)

    def take_errors(self) -> list[OffloadIOError]:
        errors, self._errors = self._errors, []
        return errors

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        discard_directory(self.engine, self.directory, remove=not self.keep_files)
        if self._own_engine:
            self.engine.close()
        self._slots.clear()

    def __contains__(self, group_id: Hashable) -> bool:
        return group_id in self._layouts

    def group_ids(self) -> Iterator[Hashable]:
        return iter(list(self._layouts))

    def layout(self, group_id: Hashable) -> GroupLayout:
        return self._layouts[group_id]

    @property
    def resident_bytes(self) -> int:
        return sum(s.buffer.numel() + self.alignment for s in self._slots) + self.engine.buffer_bytes

    def file_of(self, group_id: Hashable) -> str:
        """The file that holds ``group_id``."""
        return self._files[group_id]

    # -- slots ---------------------------------------------------------------------------------
    def _find(self, group_id: Hashable) -> _Slot | None:
        for slot in self._slots:
            if slot.group_id == group_id and slot.state != FREE:
                return slot
        return None

    def _start_write(self, slot: _Slot) -> None:
        """Start writing a slot back; a refusal (no space) keeps the data and is reported by flush()."""
        layout = self._layouts[slot.group_id]
        try:
            slot.handle = self.engine.write(slot.buffer[:layout.nbytes], self._files[slot.group_id])
        except OffloadIOError as exc:
            slot.state = FAILED
            self._errors.append(exc)
            return
        slot.state = WRITING

    def _settle(self, slot: _Slot, *, record: bool = False) -> None:
        """Wait for a slot's write-back. On failure the slot keeps its data (FAILED) and the error
        is raised, or recorded for :meth:`flush` when ``record``."""
        if slot.state != WRITING:
            return
        try:
            slot.handle.wait()
        except OffloadIOError as exc:
            slot.state = FAILED
            if not record:
                raise
            self._errors.append(exc)
            return
        slot.state = RESIDENT
        self._on_disk.add(slot.group_id)

    def _release(self, slot: _Slot) -> None:
        slot.group_id, slot.state, slot.handle = None, FREE, None

    def _take_slot(self, nbytes: int) -> _Slot:
        """A slot of at least ``nbytes`` for a new group: free, else least recently used clean or written."""
        # A slot being read (prefetched, not yet borrowed) is never evicted: it is the next group.
        free = [s for s in self._slots if s.state == FREE]
        evictable = [s for s in self._slots if s.state in (RESIDENT, WRITING)]
        if free:
            slot = free[0]
        elif len(self._slots) < self.slots_wanted or not evictable:
            # Grows past `slots` only while the caller borrows every slot or writes failed.
            slot = _Slot(aligned_empty(nbytes, alignment=self.alignment))
            self._slots.append(slot)
            return slot
        else:
            slot = min(evictable, key=lambda s: (s.state == WRITING, s.last_use))
            self._settle(slot, record=True)
            if slot.state == FAILED:  # its write failed: keep it, look again
                return self._take_slot(nbytes)
            self._release(slot)
        if slot.buffer.numel() < nbytes:
            slot.buffer = aligned_empty(nbytes, alignment=self.alignment)
        return slot
