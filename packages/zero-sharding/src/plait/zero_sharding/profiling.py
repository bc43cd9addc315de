"""Profiler ranges and the per-step breakdown of communication wait versus compute.

Every collective the engine issues runs inside ``torch.profiler.record_function`` named
``plait::zero::<what>`` (``all_gather``, ``reduce_scatter``, ``wait_all_gather``, ``step``...),
so a trace shows where the time went. Independently of the profiler, the time the Python
thread spends blocked on communication is summed per optimizer step; :class:`StepBreakdown`
reports it next to the wall time between steps, so a slow run explains itself without a trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

from torch.autograd.profiler import record_function

PREFIX = "plait::zero::"


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """Where one optimizer step's wall time went (seconds, this rank).

    Attributes:
        step_s: wall time from the previous ``optimizer.step()`` returning to this one returning
            (forward + backward + step).
        comm_wait_s: time blocked in collectives or waiting on their handles.
        optimizer_s: time inside the inner optimizer's update.
        compute_s: the rest (``step_s - comm_wait_s - optimizer_s``).
    """

    step_s: float
    comm_wait_s: float
    optimizer_s: float

    @property
    def compute_s(self) -> float:
        """Wall time not spent waiting on communication or in the optimizer update."""
        return max(0.0, self.step_s - self.comm_wait_s - self.optimizer_s)

    def as_dict(self) -> dict[str, float]:
        """Plain dict with ``compute_s`` included."""
        return {"step_s": self.step_s, "comm_wait_s": self.comm_wait_s, "optimizer_s": self.optimizer_s,
                "compute_s": self.compute_s}


class _Clock:
    """Per-process accumulators (the engine runs one step at a time per process)."""

    def __init__(self) -> None:
        self.comm = 0.0
        self.optimizer = 0.0
        self.mark = time.perf_counter()


_clock = _Clock()


@contextlib.contextmanager
def comm_range(name: str, *, block: bool = True) -> Iterator[None]:
    """A profiler range around a collective; time counts as communication wait when ``block``
    (an async launch is not a wait, its ``wait()`` is)."""
    start = time.perf_counter()
    with record_function(PREFIX + name):
        yield
    if block:
        _clock.comm += time.perf_counter() - start


@contextlib.contextmanager
def optimizer_range() -> Iterator[None]:
    """A profiler range around the inner optimizer update, timed separately."""
    start = time.perf_counter()
    with record_function(PREFIX + "optimizer_step"):
        yield
    _clock.optimizer += time.perf_counter() - start


def range_(name: str) -> record_function:
    """A plain ``plait::zero::<name>`` profiler range."""
    return record_function(PREFIX + name)


def close_step() -> StepBreakdown:
    """End the current step's accounting and start the next one."""
    now = time.perf_counter()
    out = StepBreakdown(step_s=now - _clock.mark, comm_wait_s=_clock.comm, optimizer_s=_clock.optimizer)
    _clock.comm = _clock.optimizer = 0.0
    _clock.mark = now
    return out
