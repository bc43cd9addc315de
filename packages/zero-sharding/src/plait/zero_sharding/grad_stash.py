"""Reduced gradient shards kept in a placement's storage between backward and the step.

ZeRO-Infinity's gradient offload: a placement that offers ``grad_storage()`` (plait-offload-io
with ``OffloadConfig(grad_device="nvme")``) receives each unit's reduced gradient shard as soon
as its reduction is folded, and the engine frees the shard's memory, so a rank never holds more
than the gradients still being reduced. A later micro-batch (accumulation without a step) reads
the stored sum back and adds to it. Before the step the norm is computed one unit at a time
(read, scale, norm, free) and the step receives a :class:`StashedGrad` per unit, which reads
only the element range a sub-group needs.

The values are bitwise those of the in-memory path: the same fp32 cast, the same factors applied
in the same order, the same norm over the same whole tensor. ``a + b == b + a`` in IEEE
arithmetic, so adding the stored sum to a new slice equals adding the slice to the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.zero_sharding.extension import wait

# Gradient writes allowed in flight before the oldest is waited for: each holds its shard's memory.
MAX_PENDING_WRITES = 2


class StashedGrad:
    """A unit's gradient shard that lives in a storage; what the placement's ``step`` gets
    instead of a tensor for that key.

    Args:
        storage: the gradient storage.
        key: the unit key.
        numel: elements of the shard.
        dtype: the stored dtype (the reduce dtype).
        factors: multipliers applied, in order, to the fp32 values (the averaging factor, then
            a clipping coefficient), each as its own multiplication as the in-memory path does.
    """

    def __init__(self, storage: Any, key: str, numel: int, dtype: torch.dtype,
                 factors: tuple[float, ...] = ()) -> None:
        self.storage, self.key, self.numel, self.dtype, self.factors = storage, key, numel, dtype, factors

    def __mul__(self, factor: float) -> StashedGrad:
        """The same gradient, multiplied once more by ``factor`` when read (clipping)."""
        return StashedGrad(self.storage, self.key, self.numel, self.dtype, (*self.factors, factor))

    def read(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` as fp32 with the factors applied (a new CPU tensor)."""
        return self.start_read(start, end)()

    def start_read(self, start: int = 0, end: int | None = None) -> Callable[[], torch.Tensor]:
        """Start reading elements ``[start, end)`` and return at once; calling the result waits
        and gives what :meth:`read` would (so a step can read the next sub-group's gradient while
        it updates this one)."""
        end = self.numel if end is None else end
        raw = _empty(self.storage, end - start, self.dtype)
        handle = self.storage.read(self.key, raw, offset=start * raw.element_size())

        def finish() -> torch.Tensor:
            wait(handle)
            grad = raw.to(torch.float32)  # raw is this call's own memory: scaling in place is safe
            for factor in self.factors:
                grad.mul_(factor)
            return grad

        return finish


def _empty(storage: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
    empty = getattr(storage, "empty", None)
    if empty is not None:
        return empty(numel, dtype=dtype, device="cpu")
    return torch.empty(numel, dtype=dtype)


class GradStash:
    """The engine's side of gradient offload: write folded shards, read them back.

    Args:
        storage: the placement's gradient storage (``write(key, tensor)``, ``read(key, out,
            offset=...)``, optional ``empty``).
    """

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.stored: dict[str, tuple[int, torch.dtype]] = {}  # key -> (numel, dtype) of the stored sum
        self._pending: list[tuple[Any, Any, torch.Tensor]] = []  # (unit, handle, tensor being written)

    def put(self, unit: Any) -> None:
        """Move ``unit.grad_shard`` (just folded) into the storage, adding the stored sum of an
        earlier micro-batch first; the shard's memory is freed once the write is done."""
        grad = unit.grad_shard
        if unit.key in self.stored:
            grad.add_(self.load(unit.key))
        handle = self.storage.write(unit.key, grad)
        self.stored[unit.key] = (grad.numel(), grad.dtype)
        unit.grad_shard = None
        self._pending.append((unit, handle, grad))
        while len(self._pending) > MAX_PENDING_WRITES:
            self._settle(*self._pending.pop(0))

    def load(self, key: str) -> torch.Tensor:
        """The stored sum of ``key`` (a new tensor, the stored dtype)."""
        numel, dtype = self.stored[key]
        self.settle()
        out = _empty(self.storage, numel, dtype)
        wait(self.storage.read(key, out))
        return out

    def settle(self) -> None:
        """Wait for every gradient write. A write that failed (disk full) leaves the gradient in
        memory as the unit's ``grad_shard``: nothing is lost, it just is not offloaded."""
        pending, self._pending = self._pending, []
        for entry in pending:
            self._settle(*entry)

    def _settle(self, unit: Any, handle: Any, grad: torch.Tensor) -> None:
        try:
            wait(handle)
        except OSError:
            if isinstance(unit, _Local):  # an unreduced sum stays in memory, to be reduced later
                unit.unit.local_sum = grad
                self.stored.pop(unit.key, None)
                return
            unit.grad_shard = grad
            self.stored.pop(unit.key, None)

    # ---- unreduced sums (no_sync) -------------------------------------------------------------
    def put_local(self, unit: Any, flat: torch.Tensor) -> None:
        """Add a ``no_sync`` backward's flat local gradient of ``unit`` into its stored unreduced
        sum, so the gradients wait in the storage rather than on every parameter's ``.grad``.
        ``flat`` (the unit's fresh buffer, taken off the parameters) is freed once written."""
        key = _local_key(unit)
        if key in self.stored:
            flat.add_(self.load(key))  # a + b == b + a: the order autograd's accumulation would give
        elif getattr(unit, "local_sum", None) is not None:  # an earlier write failed: it is in memory
            flat.add_(unit.local_sum)
            unit.local_sum = None
        handle = self.storage.write(key, flat)
        self.stored[key] = (flat.numel(), flat.dtype)
        self._pending.append((_Local(unit, key), handle, flat))
        while len(self._pending) > MAX_PENDING_WRITES:
            self._settle(*self._pending.pop(0))

    def take_local(self, unit: Any, flat: torch.Tensor | None) -> torch.Tensor | None:
        """The unit's flat gradient to reduce: ``flat`` (this backward's, or ``None``) plus the
        unreduced sum of earlier ``no_sync`` backward passes, which is then forgotten."""
        key = _local_key(unit)
        held = getattr(unit, "local_sum", None)  # a write that failed left it in memory
        if key not in self.stored and held is None:
            return flat
        self.settle()
        held = getattr(unit, "local_sum", None)
        earlier = held if key not in self.stored else self.load(key)
        self.stored.pop(key, None)
        unit.local_sum = None
        if flat is None:
            return earlier
        return flat.add_(earlier)

    def grad(self, unit: Any) -> StashedGrad | None:
        """The stashed gradient of ``unit`` for the step, or ``None`` when it has none stored."""
        if unit.key not in self.stored:
            return None
        numel, dtype = self.stored[unit.key]
        return StashedGrad(self.storage, unit.key, numel, dtype)

    def forget(self, unit: Any) -> None:
        """Drop ``unit``'s stored gradient and unreduced sum (``zero_grad``), after the writes in
        flight settle."""
        self.settle()
        self.stored.pop(unit.key, None)
        self.stored.pop(_local_key(unit), None)
        unit.local_sum = None


def _local_key(unit: Any) -> str:
    return f"{unit.key}.local"


class _Local:
    """A pending write of a unit's unreduced sum (what :meth:`GradStash._settle` restores)."""

    def __init__(self, unit: Any, key: str) -> None:
        self.unit, self.key = unit, key
