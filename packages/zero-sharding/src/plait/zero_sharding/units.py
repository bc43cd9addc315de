"""Flat units: the unit of communication and of storage.

A unit is a list of parameters laid out back to back in one flat buffer, padded at the end to
a multiple of the group size so every rank owns an equal slice (``shard``). For each unit a
rank holds:

* ``full``: the whole flat buffer in the compute dtype; the parameters' ``.data`` are views into
  it (for a tensor-parallel DTensor parameter, its local TP shard is: see :mod:`.tensor_parallel`).
  Resident units (stages 1/2, small parameters in stage 3) keep it allocated; sharded units
  (stage 3) shrink its storage to zero bytes when released and grow it back to gather, so every
  view (and anything autograd saved that aliases it) stays valid.
* ``shard``: this rank's slice in the compute dtype (the all-gather input). For resident units
  it is a view into ``full``; for sharded ones it is its own tensor.
* ``master``: the fp32 master slice the optimizer updates. Without mixed precision it is the
  shard itself, so no extra copy exists.
* ``grad_shard``: the reduced gradient slice (sum over the group, reduce dtype).
* ``storage`` (stage 3 with a :class:`~plait.zero_sharding.extension.ShardStorage`): where
  ``shard`` lives between gathers (CPU or NVMe, ZeRO-Infinity). While unused the shard's data is
  a one-element placeholder (same tensor, shape and dtype); it is read back before a gather
  (prefetched ahead of it) and freed once the gather is done.
* ``full_grad`` (stage 1 only): a persistent flat gradient buffer; ``param.grad`` are views.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from plait.kernels.collectives import named
from plait.kernels.sharded_state import flat_overlap
from plait.zero_sharding import profiling
from plait.zero_sharding.extension import DefaultGatherer, wait
from plait.zero_sharding.tensor_parallel import is_dtensor, local_grad, local_value, point_local


@dataclasses.dataclass
class ParamSlot:
    """Where one parameter sits in its unit's flat buffer.

    Attributes:
        name: fully qualified name in the model (the first one, for tied parameters).
        param: the live parameter.
        offset: start in the flat buffer.
        numel: number of elements.
        shape: the parameter's shape.
        global_name: the name of the global tensor this parameter is part of (default ``name``);
            differs for a parameter that lives on some ranks only (an expert under expert
            parallelism: ``experts.0.w`` on rank 1 may be ``experts.4.w`` of the whole model).
        global_shape: the global tensor's shape (default ``shape``).
        global_offset: where this parameter starts in the flattened global tensor (a dim-0 row
            offset times the row size; 0 by default).
    """

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: tuple[int, ...]
    global_name: str = ""
    global_shape: tuple[int, ...] = ()
    global_offset: int = 0

    def __post_init__(self) -> None:
        self.global_name = self.global_name or self.name
        self.global_shape = tuple(self.global_shape) or tuple(self.shape)

    @property
    def is_global(self) -> bool:
        """Whether the parameter is the whole global tensor under its own name."""
        return self.global_name == self.name and self.global_shape == tuple(self.shape)

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
        shard_multiple: each shard's length is padded to a multiple of this (whole blocks of
            blockwise-quantized optimizer state on every rank).
    """

    def __init__(self, *, key: str, slots: list[ParamSlot], group: Any, group_rank: int, group_size: int,
                 resident: bool, compute_dtype: torch.dtype, reduce_dtype: torch.dtype, option_index: int,
                 replicas: int, device: torch.device, shard_multiple: int = 1) -> None:
        self.key, self.slots, self.group = key, slots, group
        self.reduce_group = group  # stage 3: a twin of ``group`` (see plait.zero_sharding.ordering)
        self.replicate_group: Any = None  # HSDP: ranks holding the same shard; gradients all-reduced over it
        self.replicated = False  # grad_shard already all-reduced over replicate_group
        # Per-parameter-group extension points (param group's zero_reducer / zero_gatherer); None:
        # the engine's.
        self.reducer: Any = None
        self.gatherer: Any = None
        # Where reduced gradient slices go when the unit's group has a placement of its own
        # (plait.zero_sharding.placements); None: the engine's grad_device.
        self.grad_device: torch.device | None = None
        self.group_rank, self.group_size = group_rank, group_size
        self.resident, self.option_index, self.replicas = resident, option_index, replicas
        self.compute_dtype, self.reduce_dtype, self.device = compute_dtype, reduce_dtype, device
        self.numel = sum(s.numel for s in slots)
        # Shards hold whole blocks of blockwise-quantized optimizer state (shard_multiple elements).
        self.shard_numel = math.ceil(max(1, math.ceil(self.numel / group_size)) / shard_multiple) * shard_multiple
        self.padded_numel = self.shard_numel * group_size
        self.trainable = sum(1 for s in slots if s.param.requires_grad)
        self.tensor_parallel = any(is_dtensor(s.param) for s in slots)  # holds DTensor (TP) parameters
        self.grad_divisor: float = group_size  # summed gradients / this = the average the optimizer sees
        self.full = torch.zeros(0)
        self.shard = torch.zeros(0)
        self.master = torch.zeros(0)
        self.grad_shard: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None
        self.local_sum: torch.Tensor | None = None  # no_sync's unreduced sum a failed offload write kept
        self.gathered = resident
        self.held = 0  # >0 inside gathered_parameters(params): release() keeps the unit gathered
        self.pending_gather: Any = None
        self.ready = 0  # trainable params whose gradient arrived in the current backward
        self.storage: Any = None
        self.shard_loaded = True  # shard memory allocated and its values valid (or being read)
        self._shard_io: Any = None  # in-flight read or write of the shard
        self._shard_writing = False
        self._shard_failed: BaseException | None = None  # last write failed: keep the shard in memory

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
    def build(self, values: dict[str, torch.Tensor] | None, mixed: bool, stage: int, *, owned: bool = False) -> None:
        """Allocate storage and point the parameters at it.

        Args:
            values: slot name -> full value to start from; ``None`` means the parameters already
                hold their values (not on the meta device).
            mixed: keep fp32 masters apart from compute-dtype shards.
            stage: the ZeRO stage (stage 1 gets a persistent full gradient buffer).
            owned: nothing else references ``values`` (released by sharded construction), so a
                value that is exactly the master may become it without a copy.
        """
        lo, hi = self.shard_range
        master = self._adopt(values) if owned else None
        if master is None:
            master = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        # A sharded unit's full buffer is released right below: it is never written, so on the
        # CPU its pages are never touched (building costs the master, not the master twice).
        full = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device) if self.resident \
            else torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
        for slot in self.slots:
            value = values[slot.name] if values is not None else local_value(slot.param)
            flat = value.reshape(-1)
            if self.resident:
                full[slot.offset:slot.offset + slot.numel].copy_(flat)
            hit = flat_overlap(slot.flat_range, (lo, hi))
            if hit is not None and master.data_ptr() != flat.data_ptr():  # an adopted value is the master
                master[hit[0] - lo:hit[1] - lo].copy_(flat[hit[0] - slot.offset:hit[1] - slot.offset])
        self.full = full
        if self.resident:
            self.shard = full[lo:hi]
            self.master = master if mixed else self.shard
        else:
            # Without separate masters the shard is the master, in the compute dtype (a bf16 master
            # under ZeroConfig.master_dtype='bf16'; in fp32 ``to`` returns the master itself).
            self.shard = master.to(self.compute_dtype)
            self.master = master if mixed else self.shard
        self._point_params()
        if not self.resident:
            self.full.untyped_storage().resize_(0)
            self.gathered = False
        if stage == 1:
            self.full_grad = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            self._point_grads()

    def _adopt(self, values: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """The one value that is exactly this rank's master (one rank, one fp32 parameter, no
        padding), flattened, or ``None``: the master then starts as that tensor, with no copy."""
        if values is None or len(self.slots) != 1 or self.shard_numel != self.numel or self.group_size != 1:
            return None
        flat = values[self.slots[0].name].reshape(-1)
        if flat.dtype != torch.float32 or flat.device != self.device or not flat.is_contiguous():
            return None
        # detach: not a view. A view keeps its base (the whole value) alive through autograd's
        # view metadata even after its ``.data`` is swapped for a placeholder (shard offload), so
        # the memory would never be freed.
        return flat.detach()

    def _point_params(self) -> None:
        for slot in self.slots:
            point_local(slot.param, self.full[slot.offset:slot.offset + slot.numel].view(slot.shape))

    def _point_grads(self) -> None:
        """Stage 1: plain parameters' ``.grad`` are views of ``full_grad``, so autograd accumulates
        in place. A DTensor parameter's gradient stays ``None`` between backward passes: autograd
        would replace a DTensor gradient rather than add into it, so :meth:`take_dtensor_grad`
        adds each new one into the buffer instead."""
        for slot in self.slots:
            if slot.param.requires_grad and not is_dtensor(slot.param):
                slot.param.grad = self.full_grad[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def take_dtensor_grad(self, slot: ParamSlot) -> None:
        """Stage 1, a DTensor parameter's gradient just arrived: add its local tensor (reduced over
        ``tp`` first where it is ``Partial``) into ``full_grad`` and clear ``.grad``."""
        grad = slot.param.grad
        if self.full_grad is None or grad is None or not is_dtensor(slot.param):
            return
        part = self.full_grad[slot.offset:slot.offset + slot.numel]
        part.add_(local_grad(slot.param, grad).reshape(-1).to(part.dtype))
        slot.param.grad = None

    # ---- gather / release (stage 3) ----------------------------------------------------------
    def gather(self, gatherer: Any, phase: str, *, block: bool = True) -> None:
        """Make ``full`` hold every rank's shard (no-op when resident or already gathered);
        the unit's own gatherer, when its parameter group has one, replaces ``gatherer``."""
        gatherer = self.gatherer or gatherer
        if not self.gathered:
            # One rank, an offloaded shard not already read ahead: the file holds the whole unit,
            # so it is read straight into the gathered buffer (no shard copy beside it).
            direct = self.group_size == 1 and self.storage is not None and not self.shard_loaded \
                and type(gatherer) is DefaultGatherer
            if not direct:
                self.load_shard()
            self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
            if direct:
                self.pending_gather = self.storage.read(self.key, self.full)
            else:
                with profiling.comm_range("all_gather", block=False), \
                        named(f"ZeRO-3 {phase} all-gather `{self.key}`"):
                    self.pending_gather = gatherer.all_gather(self.shard, self.full, group=self.group, key=self.key,
                                                              phase=phase)
            self.gathered = True
        if block:
            self.wait_gather()

    def wait_gather(self) -> None:
        """Wait for an in-flight gather; an offloaded shard is then freed (``full`` holds it)."""
        self._wait_pending_gather()
        if self.gathered:
            self.drop_shard()

    def _wait_pending_gather(self) -> None:
        if self.pending_gather is not None:
            with profiling.comm_range("wait_all_gather"):
                wait(self.pending_gather)
            self.pending_gather = None

    def release(self) -> None:
        """Free the gathered buffer of a sharded unit (its views stay valid, zero-sized)."""
        if self.resident or not self.gathered or self.held:
            return
        self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def refresh_from_master(self, placement: Any, gatherer: Any) -> None:
        """After an optimizer step: bring the compute shard (and ``full``, when it is live) up to date."""
        self.load_from_master(placement)
        self.regather(gatherer)

    def load_from_master(self, placement: Any) -> None:
        """Copy (casting) the master into the compute shard, and into its storage when offloaded.
        A no-op when the shard is the master itself (fp32 without a placement that moves it)."""
        if self.master is not self.shard:
            placement.read_master(self.key, self.writable_shard(read=False))
            self.store_shard()

    def regather(self, gatherer: Any, *, block: bool = True) -> Any:
        """Refresh ``full`` from every rank's shard where it is live (resident or gathered).

        Args:
            gatherer: the engine's gatherer (the unit's own, when it has one, replaces it).
            block: wait for the gather here; otherwise return its handle, which the caller waits
                on before anything reads ``full``.

        Returns:
            ``None`` when blocking or when nothing was gathered; otherwise the gather's handle.
        """
        gatherer = self.gatherer or gatherer
        if self.resident:
            # torch's all_gather_into_tensor (the default gatherer) takes its input as its own
            # slice of the output (in place, as FSDP uses it on NCCL; gloo reads the input into a
            # buffer of its own first), so the shard goes as it is. Another gatherer may write
            # its output before it has read all of its input: it gets a copy.
            shard = self.shard if type(gatherer) is DefaultGatherer else self.shard.clone()
        elif self.gathered:
            self._wait_pending_gather()
            self.load_shard()
            shard = self.shard
        else:
            return None
        with profiling.comm_range("all_gather", block=block), named(f"ZeRO post-step all-gather of unit `{self.key}`"):
            handle = gatherer.all_gather(shard, self.full, group=self.group, key=self.key, phase="step")
            if block:
                wait(handle)
                return None
        return handle

    # ---- shard storage (stage 3, ZeRO-Infinity) -----------------------------------------------
    def attach_storage(self, storage: Any) -> None:
        """Keep the shard in ``storage`` from now on: write it once and free its memory.

        Raises:
            whatever the storage raises for the first write (the shard then stays in memory and
            no storage is attached).
        """
        wait(storage.write(self.key, self.shard))
        self.storage = storage
        self.drop_shard()

    def prefetch_shard(self) -> None:
        """Start reading an offloaded shard, so a later gather finds it in memory."""
        if self.storage is not None and not self.shard_loaded:
            self._allocate_shard()
            self._shard_io = self.storage.read(self.key, self.shard)

    def load_shard(self, *, read: bool = True) -> None:
        """Make ``shard`` hold its values: wait for a prefetch, or read now (``read=False``: the
        caller overwrites every element, so memory is enough)."""
        if self.storage is None:
            return
        if not self.shard_loaded:
            self._allocate_shard()
            if read:
                self._shard_io = self.storage.read(self.key, self.shard)
        if not self._shard_writing:
            self._settle_shard_io()

    def writable_shard(self, *, read: bool = True) -> torch.Tensor:
        """The shard, loaded and safe to modify (no write of it in flight); call
        :meth:`store_shard` after modifying it. ``read=False`` when every element is overwritten."""
        self.load_shard(read=read)
        self._settle_shard_io()
        return self.shard

    def store_shard(self) -> None:
        """The shard has new values: start writing them to the storage (kept in memory until
        :meth:`drop_shard` sees the write finished)."""
        if self.storage is None:
            return
        self._settle_shard_io()
        try:
            self._shard_io = self.storage.write(self.key, self.shard)
        except OSError as exc:  # refused up front (no space): kept in memory, raised by the step's end
            self._shard_failed = exc
            return
        self._shard_writing = True

    def drop_shard(self, *, retry: bool = False) -> BaseException | None:
        """Free the shard's memory once its values are safely in the storage.

        A failed write keeps the shard in memory (nothing is lost); ``retry`` writes it again.
        Outside a step (``retry=False``) a failure is only recorded, never raised, so no rank
        leaves a collective early; the step's :meth:`ZeroEngine.settle_shards` raises it.

        Returns:
            The write failure that keeps the shard in memory, or ``None``.
        """
        if self.storage is None or not self.shard_loaded or self.pending_gather is not None:
            return None
        if retry and self._shard_failed is not None:
            self._shard_failed = None
            self.store_shard()
        self._settle_shard_io()
        if self._shard_failed is not None:
            return self._shard_failed
        self._release_shard_memory()
        return None

    def _allocate_shard(self) -> None:
        # A storage may hand out memory its I/O prefers (aligned for O_DIRECT, no bounce copy).
        empty = getattr(self.storage, "empty", None) or torch.empty
        self.shard.data = empty(self.shard_numel, dtype=self.shard.dtype, device=self.device)
        self.shard_loaded = True

    def _release_shard_memory(self) -> None:
        # A one-element zero-stride placeholder: the tensor keeps its identity, shape and dtype
        # (its storage may not be resizable: it can be the tensor ZeRO built the master from).
        self.shard.data = torch.zeros((), dtype=self.shard.dtype, device=self.device).expand(self.shard_numel)
        self.shard_loaded = False

    def _settle_shard_io(self) -> None:
        """Wait for the shard's read or write. A failed write is kept in ``_shard_failed`` (the
        shard stays in memory; :meth:`drop_shard` reports it); a failed read frees the shard
        again and raises."""
        handle, writing = self._shard_io, self._shard_writing
        self._shard_io, self._shard_writing = None, False
        try:
            wait(handle)
        except OSError as exc:
            if not writing:
                self._release_shard_memory()
                raise
            self._shard_failed = exc
            return
        if writing:
            self._shard_failed = None

    # ---- gradients ----------------------------------------------------------------------------
    def flat_grads(self, *, zeros: bool = False) -> torch.Tensor | None:
        """The local gradients as one padded flat tensor in the reduce dtype, taking them off the
        parameters (stage 2/3); when no parameter has a gradient: zeros with ``zeros``, else
        ``None``."""
        if self.full_grad is not None:
            # A reduce-scatter only reads its input, so stage 1's buffer is passed as it is.
            return self.full_grad.to(self.reduce_dtype) if self.full_grad.dtype != self.reduce_dtype \
                else self.full_grad
        if not any(slot.param.grad is not None for slot in self.slots):
            return torch.zeros(self.padded_numel, dtype=self.reduce_dtype, device=self.device) if zeros else None
        # empty + explicit zeros where no gradient lands: one pass over the bucket, not two.
        flat = torch.empty(self.padded_numel, dtype=self.reduce_dtype, device=self.device)
        flat[self.numel:].zero_()
        for slot in self.slots:
            grad = slot.param.grad
            part = flat[slot.offset:slot.offset + slot.numel]
            if grad is None:
                part.zero_()
            else:
                part.copy_(local_grad(slot.param, grad).reshape(-1))
                slot.param.grad = None
        return flat

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Add a reduced slice into ``grad_shard`` (stage 1 replaces: it re-reduces everything)."""
        if self.grad_shard is None or self.full_grad is not None:
            self.grad_shard = reduced
        else:
            self.grad_shard.add_(reduced)
        self.replicated = False

    def zero_grad(self) -> None:
        """Forget gradients: the reduced slice, any unreduced ``param.grad``, stage 1's buffer."""
        self.grad_shard = None
        if self.full_grad is not None:
            self.full_grad.zero_()
            self._point_grads()
        else:
            for slot in self.slots:
                slot.param.grad = None

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the unit, by kind (optimizer state is counted elsewhere)."""
        full = self.full.untyped_storage().nbytes() if self.resident else 0
        shard = 0 if self.resident or not self.shard_loaded else self.shard.numel() * self.shard.element_size()
        master = 0 if self.master.data_ptr() == self.shard.data_ptr() else \
            self.master.numel() * self.master.element_size()
        grads = self.full_grad.numel() * self.full_grad.element_size() if self.full_grad is not None else 0
        if self.grad_shard is not None and self.full_grad is None:
            grads += self.grad_shard.numel() * self.grad_shard.element_size()
        return {"params": full + shard, "master": master, "grads": grads}
