"""The flight log: every collective plait issues, with a plait-level name, numbered and timed.

A gloo or NCCL timeout says "Timed out waiting 20000ms for recv operation"; what a person needs is
"rank 1 never entered the ZeRO-3 all-gather of unit `layers.3` at step 5". torch's own flight
recorder (on by default in torch 2.13, ``TORCH_FR_BUFFER_SIZE``) records the process group's
sequence numbers and shapes, but in each process's memory, read offline after a dump, and without
the caller's meaning. So every call through :mod:`plait.kernels.collectives` also enters an event
here:

* a **label**: ``name=`` on the call, or the innermost :func:`named` block around it (nested
  blocks are joined, ``"checkpoint save: ZeRO all-gather of unit `w`"``), plus the step set by
  :func:`set_step`;
* a **sequence number** per process group (the n-th plait collective on ``world``), the same on
  every rank that issues the same collectives, so ranks can be compared;
* **times**: entry (wall clock, comparable between ranks of one host), end, and the time this
  rank was blocked (a blocking op's duration, or an async op's ``wait()``).

Events live in a bounded ring buffer per process (``PLAIT_COLLECTIVE_HISTORY``). The hot path is a
few attribute writes and one small object; nothing here talks to another process
(:mod:`plait.kernels.collectives.hangs` publishes the latest event in the background).

Labels are per thread: a :func:`named` block in the main thread does not name collectives that an
autograd worker thread issues, which is why call sites name their own collective.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

from plait.kernels import settings


@dataclasses.dataclass(slots=True)
class CollectiveEvent:
    """One collective as this rank entered it.

    Attributes:
        seq: this rank's count of plait collectives on ``group``, from 1.
        op: the collective (``all_gather``, ``reduce_scatter``, ``all_reduce``, ...).
        label: the plait-level name (empty when the caller gave none).
        group: the process group's rank-independent name (``world``, ``ranks[0,2]``).
        step: the training step set by :func:`set_step` at entry, or ``None``.
        start: wall-clock time of entry (``time.time()``).
        end: wall-clock time it finished on this rank (``None`` while in flight).
        wait_s: seconds this rank was blocked on it.
    """

    seq: int
    op: str
    label: str
    group: str
    step: int | None
    start: float
    end: float | None = None
    wait_s: float = 0.0

    def describe(self) -> str:
        """A person's description: ``ZeRO-3 all-gather of unit `layers.3` (step 5; all_gather #12 on world)``."""
        where = f"{self.op} #{self.seq} on {self.group}"
        where = where if self.step is None else f"step {self.step}; {where}"
        return f"{self.label} ({where})" if self.label else f"unnamed {self.op} ({where})"

    def as_row(self) -> list[Any]:
        """The compact form published to other ranks: ``[seq, op, label, step, start]``."""
        return [self.seq, self.op, self.label, self.step, self.start]


class FlightLog:
    """This process's recent collectives: a ring buffer plus the latest event per group."""

    def __init__(self, size: int) -> None:
        self.events: collections.deque[CollectiveEvent] = collections.deque(maxlen=size)
        self.seqs: dict[str, int] = {}
        self.last_by_group: dict[str, CollectiveEvent] = {}
        self.latest: CollectiveEvent | None = None
        # Bumped on every entry so the publisher can tell, without comparing events, that
        # something new happened since its last report.
        self.version = 0

    def enter(self, op: str, group: str, label: str) -> CollectiveEvent:
        """Number and record a collective this rank is about to issue."""
        seq = self.seqs.get(group, 0) + 1
        self.seqs[group] = seq
        event = CollectiveEvent(seq, op, label, group, _step, time.time())
        self.events.append(event)
        self.last_by_group[group] = event
        self.latest = event
        self.version += 1
        return event

    def clear(self) -> None:
        """Forget every event and restart the sequence numbers (a new process group)."""
        self.events.clear()
        self.seqs.clear()
        self.last_by_group.clear()
        self.latest = None
        self.version += 1


class _State(threading.local):
    """Per-thread label stack."""

    def __init__(self) -> None:
        self.labels: list[str] = []


_state = _State()
_step: int | None = None  # process-wide on purpose: autograd threads report the main loop's step
LOG = FlightLog(settings.collective_history())


@contextlib.contextmanager
def named(label: str) -> Iterator[None]:
    """Name every plait collective this thread issues inside the block.

    Args:
        label: what the collective is for, in the caller's words
            (``"ZeRO-3 all-gather of unit `layers.3`"``, ``"checkpoint commit barrier"``).

    Example::

        with collectives.named(f"ZeRO-3 all-gather of unit `{key}`"):
            work = collectives.all_gather_into_tensor(full, shard, async_op=True)
    """
    _state.labels.append(label)
    try:
        yield
    finally:
        _state.labels.pop()


def set_step(step: int | None) -> None:
    """Record ``step`` (the training step, process-wide) in every collective entered from now on.

    Args:
        step: the step number, or ``None`` to stop recording one.
    """
    global _step
    _step = step


def current_label(name: str | None) -> str:
    """The label a collective issued now gets: ``name`` inside the :func:`named` blocks, joined."""
    labels = _state.labels
    if not labels:
        return name or ""
    return ": ".join([*labels, name]) if name else ": ".join(labels)


def history() -> list[CollectiveEvent]:
    """This rank's recorded collectives, oldest first (at most ``PLAIT_COLLECTIVE_HISTORY``)."""
    return list(LOG.events)


def wait_seconds(*, group: str | None = None) -> float:
    """Seconds this rank spent blocked in the collectives still in its flight log.

    Args:
        group: only this group's collectives (its :func:`~plait.kernels.collectives.group_name`).
    """
    return sum(e.wait_s for e in LOG.events if group is None or e.group == group)


def clear_history() -> None:
    """Forget this rank's recorded collectives (e.g. after warm-up; every rank must do it together,
    or sequence numbers no longer match between ranks)."""
    LOG.clear()
