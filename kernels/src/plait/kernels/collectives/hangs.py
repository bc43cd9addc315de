"""When a collective fails: name the ranks that never entered it and what each of them last did.

Each rank's *publisher*, a daemon thread, writes the latest entry of its flight log per process
group to the process group's own c10d store (``plait/flight/<rank>``), at most every
``PLAIT_COLLECTIVE_PUBLISH_S`` seconds (0.5 by default) and only when something changed. The
collective call itself never touches the store: a store ``set`` is a round trip to the store's
host, as slow as a small gloo all-gather, while a hung rank's last collective does not change, so
a report that is half a second old is as good as a fresh one by the time a timeout fires.

When a collective raises (gloo's or NCCL's timeout, a peer that closed its connection), the rank
reads the other members' reports once and, where some did not enter this collective, raises one
:class:`CollectiveError` that names them, this collective's label and step, and each missing rank's
last collective. An error where every member entered is re-raised unchanged with a note.
"""

from __future__ import annotations

import atexit
import datetime
import json
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import settings
from plait.kernels.collectives import teardown
from plait.kernels.collectives.flight import LOG, CollectiveEvent
from plait.kernels.eager import eager_only

KEY_PREFIX = "plait/flight/"
# A report is a small store write; one that takes longer than this means the store's host is in
# trouble, and the reports end there rather than holding the publisher (and so the exit) longer.
REPORT_TIMEOUT_S = 5.0
# How long exit waits for the publisher to leave a store call: a report's bound, plus room for a
# thread that a loaded machine does not schedule for a while (1 s was not always enough on CI).
STOP_TIMEOUT_S = 2 * REPORT_TIMEOUT_S
# The publisher's own client connects within this. torch's TCPStore retries a failed connect once
# after a random back-off, so a gone host is given up on after 1-2x this (measured 2.6-3.4 s). A
# live store answers in milliseconds; the margin is for a machine too loaded to schedule its host.
CONNECT_TIMEOUT_S = 2.0


class CollectiveError(dist.DistBackendError):
    """A collective failed because ranks of its group never entered it (or left it).

    A ``DistBackendError`` (so a ``RuntimeError``), so code that handles torch's own backend
    errors handles this one too.

    Attributes:
        event: this rank's record of the failed collective.
        missing: rank -> what that rank last did (or why it is not known).
        original: torch's message for the failure.
    """

    def __init__(self, message: str, event: CollectiveEvent, missing: dict[int, str], original: str) -> None:
        super().__init__(message)
        self.event = event
        self.missing = missing
        self.original = original


class _Publisher:
    """Reports this rank's latest collective per group to the default store, in the background.

    It writes through its own client of the store (``store.clone()``) with a short timeout, so a
    report never waits on the main thread's store traffic and never blocks for longer than
    :data:`REPORT_TIMEOUT_S`; and it refers to the process group weakly, so a destroyed group is
    freed when the user destroys it, not at interpreter teardown.
    """

    def __init__(self, client: Any, rank: int, interval: float) -> None:
        self.store, self.key, self.interval = client, f"{KEY_PREFIX}{rank}", interval
        self.pg = weakref.ref(dist.distributed_c10d._get_default_group())
        self.stopped = threading.Event()
        self.published, self.groups = -1, "{}"
        self.thread = threading.Thread(target=self._loop, name="plait-flight-publisher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop reporting and wait until the thread has left any store call.

        The wait has no short cap on purpose: a daemon thread that returns from a torch call
        after interpreter teardown has begun is ended with ``pthread_exit``, which aborts the
        process ("terminate called without an active exception") on Python 3.11. A report is
        bounded by :data:`REPORT_TIMEOUT_S`, so this is too, with margin for a loaded machine.
        """
        self.stopped.set()
        self.thread.join(timeout=STOP_TIMEOUT_S)
        if self.thread.is_alive():
            print(f"plait: the flight-log publisher was still in a store call {STOP_TIMEOUT_S:g} s after exit "
                  "began; the process may abort in teardown", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        try:
            self.publish()
            while not self.stopped.wait(self.interval):
                if not dist.is_initialized() or dist.distributed_c10d._get_default_group() is not self.pg():
                    break  # the group was destroyed (or replaced): its store may be gone too
                self.publish()
        except Exception:  # noqa: BLE001 - a store that went away ends the reports, never the job
            pass
        finally:
            self.stopped.set()

    def publish(self) -> None:
        """Write the latest event per group, stamped with the time of writing.

        Written every interval even when nothing changed: the time stamp is the heartbeat that
        tells a failing rank this report is newer than its failure (and so complete).
        """
        version = LOG.version
        if version != self.published:
            self.groups = json.dumps({name: event.as_row() for name, event in list(LOG.last_by_group.items())})
            self.published = version
        self.store.set(self.key, f'{{"time": {time.time()!r}, "groups": {self.groups}}}')


def _own_client(store: Any) -> Any | None:
    """A separate client of ``store`` with the report timeout; ``store`` itself where the store
    type cannot be cloned (a ``HashStore`` of a single process, a custom store); ``None`` where
    the store's host cannot be reached within :data:`CONNECT_TIMEOUT_S` (with torch's retry).

    A clone connects with the shared client's timeout, which is the job's (30 min by default),
    and retries until it runs out. The host of a ``torch.multiprocessing`` or Lightning job's
    store is rank 0's process: when it has gone, a rank starting its publisher would block that
    long before its collective ran and failed. So the shared client's timeout is shortened for
    the connect alone and put back at once (this runs on the thread that issues collectives,
    the only one using the shared client here).
    """
    try:
        shared_timeout = store.timeout
        store.set_timeout(datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a custom store without timeouts: clone it as it is
        shared_timeout = None
    try:
        client = store.clone()
        client.set_timeout(datetime.timedelta(seconds=REPORT_TIMEOUT_S))
        return client
    except dist.DistNetworkError:
        return None
    except Exception:  # noqa: BLE001 - cloning is an optimisation; the shared client still works
        return store
    finally:
        if shared_timeout is not None:
            store.set_timeout(shared_timeout)


_publisher: _Publisher | None = None
# The default group whose store could not be reached: its ranks publish nothing (weak, so a
# destroyed group is not kept alive and a new one tries again).
_unreachable: weakref.ref | None = None


@atexit.register
def _stop_at_exit() -> None:
    # A daemon thread inside a store call when the interpreter tears down aborts the process
    # (see _Publisher.stop); stopping it first keeps a finished run's exit code 0.
    if _publisher is not None:
        _publisher.stop()


def ensure_publisher() -> None:
    """Start this rank's publisher if the default group has more than one rank and none runs."""
    global _publisher, _unreachable
    if _publisher is not None and not _publisher.stopped.is_set():
        return
    interval = settings.collective_publish_interval()
    if interval == 0 or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return
    group = dist.distributed_c10d._get_default_group()
    if _unreachable is not None and _unreachable() is group:
        return
    if _publisher is None or _publisher.pg() is not group:
        LOG.clear()  # a new group numbers its collectives from 1 on every rank
    client = _own_client(store)
    if client is None:
        _unreachable = weakref.ref(group)
        print(f"plait: rank {dist.get_rank()} could not reach the c10d store within {CONNECT_TIMEOUT_S:g} s "
              "(its host has gone?); its collectives are not reported, so a hang cannot name them",
              file=sys.stderr, flush=True)
        return
    _publisher = _Publisher(client, dist.get_rank(), interval)


def members(group: Any | None) -> list[int]:
    """Global ranks of ``group`` (the default group when ``None``)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def read_reports(store: Any, ranks: list[int]) -> dict[int, dict | str]:
    """Each rank's latest report, or a string saying why there is none."""
    out: dict[int, dict | str] = {}
    for rank in ranks:
        key = f"{KEY_PREFIX}{rank}"
        try:
            out[rank] = json.loads(store.get(key)) if store.check([key]) else "it never reported a collective"
        except Exception as exc:  # noqa: BLE001 - the store's host may be the rank that died
            out[rank] = f"the c10d store could not be read ({type(exc).__name__}: {exc})"
    return out


def _describe_row(row: list[Any], group: str, now: float) -> str:
    seq, op, label, step, start = row
    return CollectiveEvent(seq, op, label, group, step, start).describe() + f", entered {now - start:.1f} s earlier"


def missing_ranks(event: CollectiveEvent, reports: dict[int, dict | str], now: float) -> dict[int, str]:
    """Ranks whose report shows they did not enter ``event``, each with what it last did.

    A rank entered ``event`` when its latest collective on the group has the same number, op and
    label; one at a lower number never got there; one at the same number with another op or label
    issued a different collective (the ranks' code paths diverged).
    """
    missing = {}
    for rank, report in reports.items():
        if isinstance(report, str):
            missing[rank] = report
            continue
        row = report["groups"].get(event.group)
        if row is None:
            missing[rank] = "it had reported no collective on " + event.group
        elif row[0] > event.seq or (row[0] == event.seq and row[1:3] == [event.op, event.label]):
            continue  # it entered this collective (and may have moved past it)
        elif row[0] == event.seq:
            missing[rank] = "it issued a different collective at this point: " + _describe_row(row, event.group, now)
        else:
            missing[rank] = "its last collective was " + _describe_row(row, event.group, now)
        if rank in missing and isinstance(report, dict):
            missing[rank] += report.get("stale", "")
    return missing


def group_timeout(group: Any | None = None) -> datetime.timedelta | None:
    """The timeout ``group`` (default: the default group) was created with, or ``None`` where
    the backend does not say.

    Groups made with ``torch.distributed.new_group`` (or a ``DeviceMesh``) without a timeout do
    not inherit the default group's: they get torch's default (30 minutes on gloo). Pass
    ``timeout=group_timeout()`` so a job's timeout governs every collective it runs.
    """
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - backends without options (or without a CPU side)
        return None


def fresh_reports(store: Any, ranks: list[int], failed_at: float) -> dict[int, dict | str]:
    """The ranks' reports, waiting up to one publish interval (and a little) for ones written
    after ``failed_at``: a live rank's report then shows everything it entered before the failure.
    The wait is short on purpose: a launcher may kill this rank soon after another one died."""
    interval = settings.collective_publish_interval()
    deadline = time.time() + interval + 0.3
    while True:
        reports = read_reports(store, ranks)
        stale = [r for r, rep in reports.items() if isinstance(rep, dict) and rep["time"] < failed_at]
        if not stale or time.time() > deadline:
            break
        time.sleep(interval / 4)
    for rank in stale:
        age = failed_at - reports[rank]["time"]
        reports[rank]["stale"] = f" (its last report came {age:.1f} s before this failure: it may have died)"
    return reports


def explain(event: CollectiveEvent, exc: BaseException, group: Any | None,
            peers: list[int] | None = None) -> BaseException:
    """The error to raise for ``exc`` from collective ``event``: a :class:`CollectiveError` naming
    the ranks that did not enter it, or ``exc`` itself (with a note) when none can be named."""
    failed_at = time.time()
    try:
        me = dist.get_rank()
        others = peers if peers is not None else [rank for rank in members(group) if rank != me]
        reports = fresh_reports(dist.distributed_c10d._get_default_store(), others, failed_at)
    except Exception as lookup:  # noqa: BLE001 - diagnosis must never hide the real failure
        exc.add_note(f"plait: could not ask the other ranks about {event.describe()}: {lookup!r}")
        return exc
    missing = missing_ranks(event, reports, failed_at)
    if not missing:
        exc.add_note(f"plait: every rank of {event.group} entered {event.describe()}")
        return exc
    original = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lines = [f"rank {rank} did not enter {event.describe()}; {why}" for rank, why in sorted(missing.items())]
    message = "\n".join(lines) + f"\n(seen from rank {me}; torch reported: {original})"
    return CollectiveError(message, event, missing, original)


# gloo reports timeouts and lost peers as plain RuntimeErrors naming its own source files.
_COMM_FAILURE_WORDS = ("gloo/", "timed out", "timeout", "connection", "peer")


def is_communication_failure(exc: RuntimeError) -> bool:
    """Whether ``exc`` from a blocking collective is about the other ranks (a timeout, a lost
    peer), not about this call's arguments (which would make asking the others misleading)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(word in text for word in _COMM_FAILURE_WORDS)


# Never traced: the flight log, the publisher and the diagnosis are Python-side bookkeeping (clocks,
# store clients, a thread) that must run as written on every call. Under torch.compile a call
# from compiled code becomes a graph break here, and the collective runs eagerly with its record.
@eager_only
def run(op: str, group: Any | None, group_label: str, label: str, peers: list[int] | None, call: Any, /,
        *args: Any, **kwargs: Any) -> Any:
    """Enter ``op`` in the flight log, issue it, and turn its failure into a named error.

    Args:
        op, group_label, label: how the flight log records it.
        group: the process group (whose members are asked on failure), or ``None`` for the default.
        peers: the ranks taking part besides this one, when not the whole group (send / recv).
        call, args, kwargs: torch's function and its arguments.

    Returns:
        What torch returned; an async op's work handle comes back as a :class:`TrackedWork`.
    """
    ensure_publisher()  # first, as starting one for a new group renumbers the log
    event = LOG.enter(op, group_label, label)
    started = time.perf_counter()
    # A blocking collective is issued async and waited on here, so its work handle can be kept
    # (teardown.keep: a gloo worker must never free it during interpreter shutdown).
    blocking = kwargs.get("async_op") is False
    if blocking:
        kwargs["async_op"] = True
    try:
        result = call(*args, **kwargs)
    except RuntimeError as exc:
        if not is_communication_failure(exc):
            raise
        raise explain(event, exc, group, peers) from None
    if result is None:
        event.wait_s = time.perf_counter() - started
        event.end = time.time()
        return None
    work = TrackedWork(result, event, group, peers, teardown.tensors_nbytes(args))
    if blocking:
        work.wait()
        return None
    return work


class TrackedWork:
    """An async collective's handle: ``wait()`` is timed and its failure named; the rest is torch's."""

    __slots__ = ("_work", "_event", "_group", "_peers", "_nbytes")

    def __init__(self, work: Any, event: CollectiveEvent, group: Any | None, peers: list[int] | None,
                 nbytes: int = teardown.KEEP_MAX_BYTES + 1) -> None:
        self._work, self._event, self._group, self._peers = work, event, group, peers
        self._nbytes = nbytes  # the tensors' bytes: whether teardown.keep holds the finished work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """torch's ``Work.wait``, timed into the flight log; a failure names the missing ranks."""
        started = time.perf_counter()
        try:
            result = self._work.wait(*args, **kwargs)
        except RuntimeError as exc:  # from wait(), every failure is the collective's
            raise explain(self._event, exc, self._group, self._peers) from None
        self._event.wait_s += time.perf_counter() - started
        self._event.end = time.time()
        teardown.keep(self._event.group, self._work, self._nbytes)
        return result

    def is_completed(self) -> bool:
        """Whether the collective has finished (torch's ``Work.is_completed``)."""
        return self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
