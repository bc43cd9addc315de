"""How the optimizers talk to the other ranks: full-precision averaging and the 1-bit exchange.

Two ways, both through :mod:`plait.kernels.collectives` so the byte ledger sees every byte:

* :func:`average_gradients` (warm-up, and 0/1 Adam's variance steps): DDP's arithmetic exactly.
  Each gradient is multiplied by ``1 / world`` and summed by an fp32 all-reduce of flat buckets,
  filled like DDP's first-iteration buckets: parameters taken in reverse order (the order
  backward produces them) until a cap (the first bucket 1 MiB, then 25 MiB), each bucket laid
  out in forward parameter order. Where the buckets are DDP's the result is bitwise DDP's; where
  they differ (DDP rebuilds its buckets in gradient-arrival order after the first iteration),
  only the order in which gloo/NCCL add the ranks' values differs.
* :class:`CompressedExchange` (after warm-up): one flat fp32 buffer per parameter group, padded to
  :func:`~plait.kernels.collectives.compressed_numel`, averaged by
  :func:`~plait.kernels.collectives.compressed_allreduce`; the worker and server error-feedback
  buffers live here, are part of the optimizer's state dict and are never reset on load.

Every collective is named in plait's flight log (the optimizer adds its own name and the param
group around these: ``OnebitAdam 1-bit exchange of param group 0: 1-bit compressed all-reduce:
worker-sign all-to-all``), so a rank that never reaches one is named in the others' error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives

FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb=25


def world_of(group: Any | None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """DDP's size-capped bucketing of ``tensors`` (in parameter order), per dtype."""
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], list[int]]] = {}
    for index in reversed(range(len(tensors))):
        tensor = tensors[index]
        bucket, size = open_by_dtype.setdefault(tensor.dtype, ([], [0]))
        bucket.append(index)
        size[0] += tensor.numel() * tensor.element_size()
        if size[0] >= (FIRST_BUCKET_BYTES if not buckets else BUCKET_BYTES):
            buckets.append(bucket)
            del open_by_dtype[tensor.dtype]
    buckets.extend(bucket for bucket, _ in open_by_dtype.values())
    return [[tensors[i] for i in sorted(bucket)] for bucket in buckets]


def average_gradients(grads: Sequence[torch.Tensor], *, group: Any | None = None) -> None:
    """Replace every gradient by its average over ``group``, in place, with DDP's arithmetic.

    Args:
        grads: the gradients, in parameter order.
        group: the data-parallel process group (``None``: the default group).
    """
    _, world = world_of(group)
    if world == 1:
        return
    buckets = _buckets(grads)
    for number, bucket in enumerate(buckets, 1):
        flat = torch.cat([g.reshape(-1) for g in bucket]).mul_(1.0 / world)
        collectives.all_reduce(flat, group=group, name=f"gradient all-reduce, bucket {number} of {len(buckets)}")
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()


class CompressedExchange:
    """The 1-bit exchange of one parameter group's tensors, with its error-feedback state.

    Args:
        numels: element counts of the group's parameters (the layout of the flat buffer).
        group: the process group.
        device: where the fp32 buffers live.
    """

    def __init__(self, numels: Sequence[int], *, group: Any | None, device: torch.device) -> None:
        self.numels = list(numels)
        self.group = group
        self.rank, self.world = world_of(group)
        self.numel = sum(self.numels)
        self.padded = collectives.compressed_numel(self.numel, self.world)
        self.worker_error = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.padded // self.world, dtype=torch.float32, device=device)
        # The flat buffer, kept across steps (not state: rebuilt from the tensors every call). A
        # fresh tensor of the whole group's size every step costs more than the exchange's
        # arithmetic on CPU (new pages); the compressed average is written back into it too.
        self._flat: torch.Tensor | None = None

    def exchange_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace ``tensors`` (this rank's values) by their 1-bit compressed average, in place.

        The 1-bit format gives every element of a chunk the same magnitude, so tensors of very
        different scales (an embedding's momentum next to a norm's) would be dominated by the
        largest. As 1-bit LAMB does, each tensor is first brought to a common scale: its RMS,
        averaged over the ranks (one small fp32 all-reduce, ``4 x tensors`` bytes), is divided
        out before the exchange and multiplied back after it. One rank exchanges nothing: the
        average of one value is the value, exactly.
        """
        if self.world == 1:
            return
        rms = torch.stack([torch.linalg.vector_norm(t.float()) / math.sqrt(max(t.numel(), 1)) for t in tensors])
        collectives.all_reduce(rms, group=self.group, name="per-tensor RMS all-reduce")
        rms.mul_(1.0 / self.world)
        united = rms.mean()
        factors = torch.where(rms > 0, united / rms, 1.0).tolist()
        flat = self._buffer()
        offset = 0
        for tensor, factor in zip(tensors, factors):
            torch.mul(tensor.reshape(-1), factor, out=flat[offset: offset + tensor.numel()])
            offset += tensor.numel()
        result = collectives.compressed_allreduce(flat, self.worker_error, self.server_error, group=self.group,
                                                  out=flat)
        offset = 0
        for tensor, factor in zip(tensors, factors):
            torch.div(result[offset: offset + tensor.numel()].view_as(tensor), factor, out=tensor)
            offset += tensor.numel()
        flat[self.numel:].zero_()  # the padding goes in as zeros next time

    def _buffer(self) -> torch.Tensor:
        """The flat fp32 buffer of the exchange (``padded`` elements, its padding zero)."""
        if self._flat is None:
            self._flat = torch.zeros(self.padded, dtype=torch.float32, device=self.worker_error.device)
        return self._flat

    def reset_errors(self) -> None:
        """Zero both error buffers (0/1 Adam does this when the exchanged quantity changes)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def nbytes_per_call(self) -> int:
        """Logical bytes one :meth:`exchange_` records in the ledger on this rank."""
        if self.world == 1:
            return 0
        return collectives.compressed_allreduce_nbytes(self.padded, self.world) + 4 * len(self.numels)

    def state_dict(self) -> dict[str, Any]:
        """The error-feedback state, with the layout it belongs to (rank, world, sizes)."""
        return {"rank": self.rank, "world": self.world, "numel": self.numel,
                "worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the error buffers saved by :meth:`state_dict` on the same rank of the same world.

        Raises:
            ValueError: the state was saved on another rank, world size or parameter layout
                (per-rank error feedback cannot be resharded from one rank's file).
        """
        saved = (state["rank"], state["world"], state["numel"])
        if saved != (self.rank, self.world, self.numel):
            raise ValueError(
                f"error-feedback state of rank {saved[0]} of {saved[1]} ({saved[2]} elements) cannot be loaded on "
                f"rank {self.rank} of {self.world} ({self.numel} elements): each rank holds its own errors. Load "
                "each rank's own optimizer state at the same world size, or drop the optimizer state."
            )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])
