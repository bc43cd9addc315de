"""Flat units: the unit of communication and of storage.

A unit is a list of parameters laid out back to back in one flat buffer, padded at the end to
a multiple of the group size so every rank owns an equal slice (``shard``). For each unit a
rank holds:

* ``full``: the whole flat buffer in the compute dtype; the parameters' ``.data`` are views into
  it. Resident units (stages 1/2, small parameters in stage 3) keep it allocated; sharded units
  (stage 3) shrink its storage to zero bytes when released and grow it back to gather, so every
  view (and anything autograd saved that aliases it) stays valid.
* ``shard``: this rank's slice in the compute dtype (the all-gather input). For resident units
  it is a view into ``full``; for sharded ones it is its own tensor.
* ``master``: the fp32 master slice the optimizer updates. Without mixed precision it is the
  shard itself, so no extra copy exists.
* ``grad_shard``: the reduced gradient slice (sum over the group, reduce dtype).
* ``full_grad`` (stage 1 only): a persistent flat gradient buffer; ``param.grad`` are views.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from plait.kernels.sharded_state import flat_overlap
from plait.zero_sharding import profiling
from plait.zero_sharding.extension import wait


@dataclasses.dataclass
class ParamSlot:
    """Where one parameter sits in its unit's flat buffer.

    Attributes:
        name: fully qualified name in the model (the first one, for tied parameters).
        param: the live parameter.
        offset: start in the flat buffer.
        numel: number of elements.
        shape: the parameter's shape.
    """

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def flat_range(self) -> tuple[int, int]:
        """``(start, stop)`` in the unit's flat buffer."""
        return self.offset, self.offset + self.numel


class FlatUnit:
    """One unit's storage and its communication, see the module docstring.

    Args:
        key: stable id (same on every rank), e.g. ``"u3"``.
        slots: the parameters, with offsets already assigned.
        group: process group the unit is sharded over.
        group_rank: this rank's index in ``group``.
        group_size: number of ranks in ``group``.
        resident: keep ``full`` allocated at all times.
        compute_dtype: dtype of ``full`` and ``shard``.
        reduce_dtype: dtype gradients are reduced in.
        option_index: which user parameter group (optimizer options) the unit belongs to.
        device: where the unit's storage lives (the compute device).
        replicas: how many times an identical copy of this unit exists outside ``group``
            (used to count each element once in the global gradient norm).
    """

    def __init__(self, *, key: str, slots: list[ParamSlot], group: Any, group_rank: int, group_size: int,
                 resident: bool, compute_dtype: torch.dtype, reduce_dtype: torch.dtype, option_index: int,
                 replicas: int, device: torch.device) -> None:
        self.key, self.slots, self.group = key, slots, group
        self.group_rank, self.group_size = group_rank, group_size
        self.resident, self.option_index, self.replicas = resident, option_index, replicas
        self.compute_dtype, self.reduce_dtype, self.device = compute_dtype, reduce_dtype, device
        self.numel = sum(s.numel for s in slots)
        self.shard_numel = max(1, math.ceil(self.numel / group_size))
        self.padded_numel = self.shard_numel * group_size
        self.trainable = sum(1 for s in slots if s.param.requires_grad)
        self.full = torch.zeros(0)
        self.shard = torch.zeros(0)
        self.master = torch.zeros(0)
        self.grad_shard: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None
        self.gathered = resident
        self.pending_gather: Any = None
        self.ready = 0  # trainable params whose gradient arrived in the current backward

    # ---- layout -------------------------------------------------------------------------------
    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's ``(start, stop)`` in the padded flat buffer."""
        start = self.group_rank * self.shard_numel
        return start, start + self.shard_numel

    def local_pieces(self) -> list[tuple[ParamSlot, tuple[int, int], tuple[int, int]]]:
        """For every parameter overlapping this rank's shard: (slot, range within the parameter,
        range within the shard). Parameters (or padding) outside the shard are skipped."""
        out = []
        lo, hi = self.shard_range
        for slot in self.slots:
            hit = flat_overlap(slot.flat_range, (lo, hi))
            if hit is not None:
                out.append((slot, (hit[0] - slot.offset, hit[1] - slot.offset), (hit[0] - lo, hit[1] - lo)))
        return out

    # ---- construction -------------------------------------------------------------------------
    def build(self, values: dict[str, torch.Tensor] | None, mixed: bool, stage: int) -> None:
        """Allocate storage and point the parameters at it.

        Args:
            values: slot name -> full value to start from; ``None`` means the parameters already
                hold their values (not on the meta device).
            mixed: keep fp32 masters apart from compute-dtype shards.
            stage: the ZeRO stage (stage 1 gets a persistent full gradient buffer).
        """
        full = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device)
        lo, hi = self.shard_range
        master = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        for slot in self.slots:
            value = values[slot.name] if values is not None else slot.param.detach()
            flat = value.reshape(-1)
            full[slot.offset:slot.offset + slot.numel].copy_(flat)
            hit = flat_overlap(slot.flat_range, (lo, hi))
            if hit is not None:
                master[hit[0] - lo:hit[1] - lo].copy_(flat[hit[0] - slot.offset:hit[1] - slot.offset])
        self.full = full
        if self.resident:
            self.shard = full[lo:hi]
            self.master = master if mixed else self.shard
        else:
            self.master = master
            self.shard = master if not mixed else master.to(self.compute_dtype)
        self._point_params()
        if not self.resident:
            self.full.untyped_storage().resize_(0)
            self.gathered = False
        if stage == 1:
            self.full_grad = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            for slot in self.slots:
                if slot.param.requires_grad:
                    slot.param.grad = self.full_grad[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def _point_params(self) -> None:
        for slot in self.slots:
            slot.param.data = self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)

    # ---- gather / release (stage 3) ----------------------------------------------------------
    def gather(self, gatherer: Any, phase: str, *, block: bool = True) -> None:
        """Make ``full`` hold every rank's shard (no-op when resident or already gathered)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
            with profiling.comm_range("all_gather", block=False):
                self.pending_gather = gatherer.all_gather(self.shard, self.full, group=self.group, key=self.key,
                                                          phase=phase)
            self.gathered = True
        if block:
            self.wait_gather()

    def wait_gather(self) -> None:
        """Wait for an in-flight gather."""
        if self.pending_gather is not None:
            with profiling.comm_range("wait_all_gather"):
                wait(self.pending_gather)
            self.pending_gather = None

    def release(self) -> None:
        """Free the gathered buffer of a sharded unit (its views stay valid, zero-sized)."""
        if self.resident or not self.gathered:
            return
        self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def refresh_from_master(self, placement: Any, gatherer: Any, mixed: bool) -> None:
        """After an optimizer step: bring the compute shard (and ``full``, when it is live) up to date."""
        if mixed or self.master is not self.shard:
            placement.read_master(self.key, self.shard)
        if self.resident:
            shard = self.shard.clone()  # the gather input must not alias its output for every gatherer
            with profiling.comm_range("all_gather"):
                wait(gatherer.all_gather(shard, self.full, group=self.group, key=self.key, phase="step"))
        elif self.gathered:
            self.wait_gather()
            with profiling.comm_range("all_gather"):
                wait(gatherer.all_gather(self.shard, self.full, group=self.group, key=self.key, phase="step"))

    # ---- gradients ----------------------------------------------------------------------------
    def flat_grads(self) -> torch.Tensor | None:
        """The local gradients as one padded flat tensor in the reduce dtype, taking them off the
        parameters (stage 2/3); ``None`` when no parameter has a gradient."""
        if self.full_grad is not None:
            # A reduce-scatter only reads its input, so stage 1's buffer is passed as it is.
            return self.full_grad.to(self.reduce_dtype) if self.full_grad.dtype != self.reduce_dtype \
                else self.full_grad
        if not any(slot.param.grad is not None for slot in self.slots):
            return None
        # empty + explicit zeros where no gradient lands: one pass over the bucket, not two.
        flat = torch.empty(self.padded_numel, dtype=self.reduce_dtype, device=self.device)
        flat[self.numel:].zero_()
        for slot in self.slots:
            grad = slot.param.grad
            part = flat[slot.offset:slot.offset + slot.numel]
            if grad is None:
                part.zero_()
            else:
                part.copy_(grad.reshape(-1))
                slot.param.grad = None
        return flat

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Add a reduced slice into ``grad_shard`` (stage 1 replaces: it re-reduces everything)."""
        if self.grad_shard is None or self.full_grad is not None:
            self.grad_shard = reduced
        else:
            self.grad_shard.add_(reduced)

    def zero_grad(self) -> None:
        """Forget gradients: the reduced slice, any unreduced ``param.grad``, stage 1's buffer."""
        self.grad_shard = None
        if self.full_grad is not None:
            self.full_grad.zero_()
            for slot in self.slots:
                if slot.param.requires_grad:
                    slot.param.grad = self.full_grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
        else:
            for slot in self.slots:
                slot.param.grad = None

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the unit, by kind (optimizer state is counted elsewhere)."""
        full = self.full.untyped_storage().nbytes() if self.resident else 0
        shard = 0 if self.resident else self.shard.numel() * self.shard.element_size()
        master = 0 if self.master.data_ptr() == self.shard.data_ptr() else self.master.numel() * 4
        grads = self.full_grad.numel() * self.full_grad.element_size() if self.full_grad is not None else 0
        if self.grad_shard is not None and self.full_grad is None:
            grads += self.grad_shard.numel() * self.grad_shard.element_size()
        return {"params": full + shard, "master": master, "grads": grads}
