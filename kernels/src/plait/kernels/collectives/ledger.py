"""The byte ledger: logical bytes of every collective, per op and per process group.

"Logical bytes" (shared/benchmarks.md) are ``numel x itemsize`` of the full logical tensor an op
moves: the all-gather output, the reduce-scatter input, the all-reduce tensor, the all-to-all
input this rank sends, the broadcast / send / recv tensor. They are deterministic, unlike gloo
wall time, and are what the ZeRO paper's formulas count. :meth:`ByteLedger.volume` counts an
all-reduce twice, because an all-reduce is a reduce-scatter plus an all-gather and the formulas
(DDP = 2 Psi, ZeRO-1/2 = 2 Psi, ZeRO-3 = 3 Psi) count it that way.

Ledgers nest: every active ledger in this process records every op.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# An all-reduce moves its payload twice in the formulas we check against (RS + AG).
VOLUME_FACTOR = {"all_reduce": 2}


@dataclasses.dataclass(frozen=True)
class CommRecord:
    """One collective as the ledger saw it.

    Attributes:
        op: the collective's name (``all_gather``, ``reduce_scatter``, ``all_reduce``,
            ``all_to_all``, ``broadcast``, ``send``, ``recv``).
        group: a stable name of the process group (see :func:`group_name`).
        nbytes: logical bytes (numel x itemsize of the op's full logical tensor).
        dtype: the element type moved.
        source: ``"plait"`` for calls through plait's wrappers, ``"torch.distributed"`` for
            calls counted from outside (peers).
    """

    op: str
    group: str
    nbytes: int
    dtype: torch.dtype
    source: str = "plait"


_active: list[ByteLedger] = []
_lock = threading.Lock()


def group_name(group: Any | None) -> str:
    """A readable, rank-independent name for a process group: ``world`` or ``ranks[0,2]``."""
    if group is None or group is dist.group.WORLD:
        return "world"
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, AttributeError):
        return f"group@{id(group):x}"
    if dist.is_initialized() and len(ranks) == dist.get_world_size():
        return "world"
    return "ranks[" + ",".join(str(r) for r in ranks) + "]"


def record(op: str, group: Any | None, tensor_bytes: int, dtype: torch.dtype, source: str = "plait") -> None:
    """Add one op to every active ledger (a no-op when none is active: the hot path stays cheap)."""
    if not _active:
        return
    rec = CommRecord(op=op, group=group_name(group), nbytes=int(tensor_bytes), dtype=dtype, source=source)
    with _lock:
        for ledger in _active:
            ledger.records.append(rec)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """numel x itemsize of ``tensor``."""
    return tensor.numel() * tensor.element_size()


class ByteLedger:
    """Context manager recording the logical bytes of every collective issued inside it.

    Example::

        with ByteLedger() as ledger:
            loss.backward(); optimizer.step()
        print(ledger.total(), ledger.by_op())
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> ByteLedger:
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _active.remove(self)

    def total(self, *, op: str | None = None, group: str | None = None, source: str | None = None) -> int:
        """Sum of logical bytes, optionally filtered by op, group name and source."""
        return sum(r.nbytes for r in self._select(op, group, source))

    def volume(self, *, group: str | None = None, source: str | None = None) -> int:
        """Bytes in the ZeRO paper's units: an all-reduce counts twice (RS + AG)."""
        return sum(r.nbytes * VOLUME_FACTOR.get(r.op, 1) for r in self._select(None, group, source))

    def by_op(self) -> dict[str, int]:
        """op -> logical bytes."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.op] += r.nbytes
        return dict(out)

    def by_group(self) -> dict[str, int]:
        """process-group name -> logical bytes."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.group] += r.nbytes
        return dict(out)

    def count(self, op: str | None = None) -> int:
        """How many ops (of one kind) were recorded."""
        return sum(1 for _ in self._select(op, None, None))

    def clear(self) -> None:
        """Forget what was recorded (e.g. after warm-up steps)."""
        self.records.clear()

    def _select(self, op: str | None, group: str | None, source: str | None) -> Iterator[CommRecord]:
        for r in self.records:
            if (op is None or r.op == op) and (group is None or r.group == group) and (
                source is None or r.source == source
            ):
                yield r
