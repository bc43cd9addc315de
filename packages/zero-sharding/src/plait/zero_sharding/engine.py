"""The engine: every hook the ZeRO stages need, registered in one place.

* Gradient hooks (stages 2/3): ``register_post_accumulate_grad_hook`` on each parameter counts
  the unit's gradients; when a unit's last gradient arrives its bucket is reduce-scattered
  (asynchronously, overlapping the rest of backward) and, in stage 3, its gathered parameters
  are freed. A callback queued on the autograd engine finishes every unit at the end of
  backward (waits for reductions, handles parameters that got no gradient).
* Module hooks (stage 3): a forward pre-hook gathers a unit and prefetches the next ones in
  forward order; a forward post-hook frees it and registers a multi-grad hook on the outputs,
  which gathers it again (prefetching in backward order) when backward reaches it. A submodule
  called directly, outside the model's forward, gathers what it needs itself
  (:mod:`plait.zero_sharding.direct_calls`).

Every collective follows an order fixed by the model's structure, never by which hooks fired on
this rank (see :mod:`plait.zero_sharding.ordering`), so ranks that run different modules or get
gradients for different units (MoE experts) still pair up the right units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from plait.kernels.collectives import named
from plait.kernels.eager import eager_only
from plait.zero_sharding import profiling
from plait.zero_sharding.config import ZeroConfig
from plait.zero_sharding.direct_calls import DirectCalls
from plait.zero_sharding.extension import DefaultReducer, wait
from plait.zero_sharding.grad_stash import GradStash
from plait.zero_sharding.ordering import GatherCursor, module_orders, reduce_order, twin_groups
from plait.zero_sharding.partition import Partition
from plait.zero_sharding.scoped_gather import register_owner
from plait.zero_sharding.tensor_parallel import is_dtensor
from plait.zero_sharding.units import FlatUnit
from plait.zero_sharding.validation import check_no_compiled_autograd

# Reduce-scatters in flight during backward before the oldest is waited for (its flat bucket
# freed): two keep communication overlapped with the next unit's backward.
MAX_PENDING_REDUCE = 2


def _finished(handle: Any) -> bool:
    """Whether waiting on ``handle`` cannot block (done, or a handle that cannot tell)."""
    check = getattr(handle, "is_completed", None)
    return handle is None or check is None or bool(check())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Floating tensors requiring grad inside ``obj`` (pytrees, dataclasses, dicts)."""
    if hasattr(obj, "__dataclass_fields__"):
        obj = [getattr(obj, name) for name in obj.__dataclass_fields__]
    leaves = pytree.tree_leaves(obj)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            out.append(leaf)
        elif hasattr(leaf, "__dataclass_fields__"):
            out.extend(_tensors(leaf))
    return out


class ZeroEngine:
    """Holds the partition and runs communication around forward and backward.

    Args:
        model: the sharded model.
        config: the engine config.
        partition: units built by :func:`plait.zero_sharding.partition.build_partition`.
        reducer, gatherer, placement: the extension points (see :mod:`.extension`).
    """

    def __init__(self, model: nn.Module, config: ZeroConfig, partition: Partition, *, reducer: Any,
                 gatherer: Any, placement: Any) -> None:
        self.model, self.config, self.partition = model, config, partition
        self.reducer, self.gatherer, self.placement = reducer, gatherer, placement
        self.units = partition.units
        self.device = self.units[0].device if self.units else torch.device("cpu")
        self.require_sync = True
        self.pinned = 0  # >0 inside gathered_parameters(): hooks neither gather nor free
        self.pending_reduce: list[tuple[FlatUnit, Any, torch.Tensor, torch.Tensor]] = []
        self.callback_queued = False
        self.reduce_order = reduce_order(model, self.units)
        self.reduce_next = 0  # reduce_order[:reduce_next] are launched in this backward
        self.unsynced = False  # a backward ran without gradient sync since the last reduction
        forward, backward = module_orders(model, list(partition.module_units))
        units_of = partition.module_units.__getitem__
        self.forward_pass = GatherCursor(forward, units_of, lambda us: self._catch_up(us, "forward"),
                                         self._release_caught_up)
        self.backward_pass = GatherCursor(backward, units_of, lambda us: self._catch_up(us, "backward"),
                                          self._release_caught_up)
        self.handles: list[Any] = []
        self.storage: Any = None
        # Optional placement attribute: where reduced gradient slices should live (host memory
        # when the optimizer steps on the CPU); None keeps them on the compute device.
        grad_device = getattr(placement, "grad_device", None)
        self.grad_device = None if grad_device is None else torch.device(grad_device)
        self.host_copies_pending = False
        self.grad_stash: GradStash | None = None  # gradient offload, see attach_grad_storage
        # Pipeline stages of the model this one is a stage of (set by ZeroPipelineStage): the
        # ranks of the other stages hold other parameters, not copies of these (see norm_copies).
        self.pipeline_stages = 1
        self._register_grad_hooks()
        register_owner(self)
        if config.stage == 3:
            twins = twin_groups(self.units)
            for unit in self.units:
                unit.reduce_group = twins.get(id(unit.group), unit.group)
            self._register_module_hooks()

    def norm_copies(self, unit: FlatUnit) -> int:
        """How many ranks of the world hold ``unit``'s shard: what its squared gradient is divided by
        in the global norm's world all-reduce. ``unit.replicas`` counts every rank outside the
        sharding group; under a pipeline only those of this rank's own stage hold the same
        parameters, so the other stages' ranks are taken out (else the norm of a model cut into
        ``pp`` stages would come out ``sqrt(pp)`` times too small and clipping would bind late)."""
        if unit.replicas == 1:  # distinct parameters (experts): every rank's are its own already
            return 1
        return max(1, unit.replicas // self.pipeline_stages)

    # ---- registration -------------------------------------------------------------------------
    def _register_grad_hooks(self) -> None:
        for unit in self.units:
            for slot in unit.slots:
                if slot.param.requires_grad and unit.full_grad is not None and is_dtensor(slot.param):
                    # Stage 1: the DTensor gradient goes into the flat buffer first (see FlatUnit._point_grads).
                    self.handles.append(slot.param.register_post_accumulate_grad_hook(
                        lambda p, unit=unit, slot=slot: unit.take_dtensor_grad(slot)))
                if slot.param.requires_grad:
                    self.handles.append(slot.param.register_post_accumulate_grad_hook(
                        lambda p, unit=unit: self._on_grad(unit)))

    def _register_module_hooks(self) -> None:
        for module, units in self.partition.module_units.items():
            self.handles.append(module.register_forward_pre_hook(
                lambda m, args, units=units: self._pre_forward(m, units)))
            self.handles.append(module.register_forward_hook(
                lambda m, args, out, units=units: self._post_forward(m, units, out)))
        root = self.partition.root_units
        self.handles.append(self.model.register_forward_pre_hook(lambda m, args: self._root_pre_forward(root)))
        self.handles.append(self.model.register_forward_hook(lambda m, args, out: self._root_post_forward(root)))
        # A submodule called directly (model.model(...), model.lm_head(...)) gathers what it needs.
        self.handles.extend(DirectCalls(self).register())

    def remove_hooks(self) -> None:
        """Detach every hook (used when a model is sharded again)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ---- stage 3 forward ----------------------------------------------------------------------
    # The module hooks below are never traced by torch.compile (``eager_only``: torch.compiler.disable
    # without importing dynamo before something compiles): they issue collectives through the
    # flight recorder, mutate the units' buffers and follow the
    # ordering cursors, decisions that depend on which hooks fired on this rank. A compiled block
    # or model therefore breaks its graph at the hook call (the hook loop of ``Module.__call__``),
    # never inside the block's own forward, and the hooks run in the eager order.
    @eager_only
    def _root_pre_forward(self, root: list[FlatUnit]) -> None:
        if not _in_backward() and not self.pinned:
            self.forward_pass.start()
        for unit in root:
            unit.gather(self.gatherer, "forward")

    @eager_only
    def _root_post_forward(self, root: list[FlatUnit]) -> None:
        if not _in_backward():
            self.forward_pass.finish()  # modules this rank skipped are gathered as everywhere else
        if not torch.is_grad_enabled() and not self.pinned:
            for unit in root:
                unit.release()

    def _catch_up(self, units: list[FlatUnit], phase: str) -> None:
        """Gather the units of a module this rank has not reached, where the other ranks may."""
        for unit in units:
            unit.gather(self.gatherer, phase, block=False)

    def _release_caught_up(self, units: list[FlatUnit]) -> None:
        # Forward without resharding keeps everything until backward ends; backward's end
        # releases every unit anyway.
        if self.config.reshard_after_forward and not self.pinned:
            for unit in units:
                unit.release()

    @eager_only
    def _pre_forward(self, module: nn.Module, units: list[FlatUnit]) -> None:
        if self.pinned:
            return
        with profiling.range_("pre_forward"):
            recompute = _in_backward()  # activation checkpointing re-runs forward inside backward
            if recompute:
                self._queue_callback()  # a reentrant recompute can come before any backward hook
            cursor = self.backward_pass if recompute else self.forward_pass
            phase = "backward" if recompute else "forward"
            position = cursor.reach(module)
            for unit in units:
                unit.gather(self.gatherer, phase)
            if not recompute:
                self._prefetch(cursor, position, phase)

    @eager_only
    def _post_forward(self, module: nn.Module, units: list[FlatUnit], out: Any) -> None:
        if self.pinned or _in_backward():
            return
        if self.config.reshard_after_forward:
            for unit in units:
                unit.release()
        if torch.is_grad_enabled():
            tensors = _tensors(out)
            if tensors:
                # Not kept in self.handles: the hook lives on this graph and dies with it.
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, m=module, us=units: self._pre_backward(m, us), mode="any")

    def _prefetch(self, cursor: GatherCursor, position: int | None, phase: str) -> None:
        """Start gathering the next modules of the pass (in its order: prefetches are part of
        the sequence every rank issues)."""
        if not self.config.prefetch or position is None or not cursor.active:
            return
        ahead = cursor.ahead(position, self.config.prefetch + 1)
        for module in ahead[:self.config.prefetch]:
            for unit in self.partition.module_units[module]:
                unit.gather(self.gatherer, phase, block=False)
        # Offloaded shards: start reading one module further, so that read overlaps this
        # module's compute and the next one's gather (double buffering of ZeRO-Infinity).
        if self.storage is not None and len(ahead) > self.config.prefetch:
            for unit in self.partition.module_units[ahead[-1]]:
                unit.prefetch_shard()

    # ---- backward -----------------------------------------------------------------------------
    # Not traced either: compiled autograd would otherwise trace this multi-grad hook's gathers.
    @eager_only
    def _pre_backward(self, module: nn.Module, units: list[FlatUnit]) -> None:
        self._queue_callback()
        if self.pinned:
            return
        with profiling.range_("pre_backward"):
            position = self.backward_pass.reach(module)
            for unit in units:
                unit.gather(self.gatherer, "backward")
            self._prefetch(self.backward_pass, position, "backward")

    def _queue_callback(self) -> None:
        if not self.callback_queued:
            check_no_compiled_autograd(self.config.stage, running=True)  # it would never call back
            self.callback_queued = True
            if self.config.stage == 3 and not self.pinned:
                self.backward_pass.start()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            started = getattr(self.placement, "backward_started", None)
            if started is not None:
                started()  # a backward begins: e.g. offloaded optimizer state can start reading

    # Not traced: under compiled autograd this post-accumulate-grad hook would be traced into the
    # backward graph, where dynamo refuses its queue_callback with an assertion; disabled, it runs
    # eagerly and _queue_callback refuses compiled autograd with a message naming the setting.
    @eager_only
    def _on_grad(self, unit: FlatUnit) -> None:
        self._queue_callback()
        unit.ready += 1
        if unit.ready < unit.trainable:
            return
        if self.config.stage >= 2 and self.require_sync and self.config.overlap_comm:
            self._launch_ready()
        elif self.config.stage >= 2 and not self.require_sync and self._stashes(unit):
            # no_sync with gradient offload: this backward's local gradient joins the unit's
            # unreduced sum in the storage instead of waiting on every parameter's .grad
            flat = unit.flat_grads()
            if flat is not None:
                self.grad_stash.put_local(unit, flat)
        if not self.pinned and not (self.config.stage == 3 and not self.config.reshard_after_forward):
            unit.release()

    def _launch_ready(self) -> None:
        """Launch reductions in :attr:`reduce_order` while the next one is ready."""
        order = self.reduce_order
        while self.reduce_next < len(order) and order[self.reduce_next].ready >= order[self.reduce_next].trainable:
            self._launch_reduce(order[self.reduce_next], zeros=True)
            self.reduce_next += 1

    def _launch_remaining(self) -> None:
        """Launch every reduction not launched yet, in order, zeros where a unit has no gradient."""
        for unit in self.reduce_order[self.reduce_next:]:
            self._launch_reduce(unit, zeros=True)
        self.reduce_next = 0

    def _stashes(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s gradients go to the gradient storage (see :meth:`_fold`)."""
        return self.grad_stash is not None and unit.full_grad is None and unit.replicate_group is None

    def _launch_reduce(self, unit: FlatUnit, *, zeros: bool = False) -> None:
        if self._stashes(unit):
            flat = self.grad_stash.take_local(unit, unit.flat_grads())  # plus earlier no_sync passes
            if flat is None and zeros:
                flat = unit.flat_grads(zeros=True)
        else:
            flat = unit.flat_grads(zeros=zeros)
        if flat is None:
            return
        reducer = unit.reducer or self.reducer
        if unit.group_size == 1 and unit.full_grad is None and type(reducer) is DefaultReducer:
            # A reduce-scatter over one rank is the identity: the fresh flat buffer is the shard.
            # Folding now, not through the async queue, also keeps one rank's backward from
            # holding every unit's buffer twice (gloo finishes them late on a busy CPU).
            self._fold(unit, None, flat, flat[:unit.shard_numel])
            return
        out = torch.empty(unit.shard_numel, dtype=unit.reduce_dtype, device=unit.device)
        # The flat bucket is this call's own (not stage 1's buffer, not a stash's sum): the default
        # reducer may reduce it in place (gloo then skips copying the whole bucket first).
        scratch = {"scratch": True} if type(reducer) is DefaultReducer and unit.full_grad is None \
            and not self._stashes(unit) else {}
        with profiling.comm_range("reduce_scatter", block=False), named(f"ZeRO reduce-scatter of unit `{unit.key}`"):
            handle = reducer.reduce_scatter(flat, out, group=unit.reduce_group, key=unit.key, **scratch)
        self.pending_reduce.append((unit, handle, flat, out))
        # Bound the flat gradient buckets alive at once: fold reductions that are done. Waiting
        # for one still in flight could deadlock when ranks reach it at different points of
        # backward (rank-dependent usage), so only a handle that cannot say is waited for.
        while len(self.pending_reduce) > MAX_PENDING_REDUCE and _finished(self.pending_reduce[0][1]):
            self._fold(*self.pending_reduce.pop(0))

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        if self.config.stage == 3 and not self.pinned:
            self.backward_pass.finish()
        if self.config.stage >= 2:
            if self.require_sync:
                self._launch_remaining()
                self.unsynced = False
            else:
                self.unsynced = True
        self.wait_reductions()
        for unit in self.units:
            unit.ready = 0
            if not self.pinned:
                unit.release()

    def wait_reductions(self) -> None:
        """Wait for every in-flight reduce-scatter and fold the results into ``grad_shard``."""
        pending, self.pending_reduce = self.pending_reduce, []
        for unit, handle, flat, out in pending:
            self._fold(unit, handle, flat, out)

    def _fold(self, unit: FlatUnit, handle: Any, _flat: torch.Tensor, out: torch.Tensor) -> None:
        with profiling.comm_range("wait_reduce_scatter"):
            wait(handle)
        unit.accumulate(self._to_grad_device(unit, out))
        # Gradient offload: a folded shard goes to the storage now (HSDP shards stay: they are
        # all-reduced over the replicas before the step; stage 1 re-reduces its full buffer).
        if self._stashes(unit):
            self.grad_stash.put(unit)

    def _to_grad_device(self, unit: FlatUnit, reduced: torch.Tensor) -> torch.Tensor:
        """Move a reduced gradient slice to the placement's ``grad_device`` (host memory for CPU
        offload) as soon as its reduction is done, so the copy overlaps the rest of backward:
        asynchronous into page-locked memory; :meth:`finish_gradients` synchronizes once."""
        target = unit.grad_device if unit.grad_device is not None else self.grad_device
        if target is None or reduced.device == target:
            return reduced
        host = torch.empty(reduced.shape, dtype=reduced.dtype, device=target, pin_memory=reduced.is_cuda)
        host.copy_(reduced, non_blocking=reduced.is_cuda)
        self.host_copies_pending = self.host_copies_pending or reduced.is_cuda
        if unit.grad_shard is not None and unit.full_grad is None:
            self.sync_host_copies()  # accumulating on the host reads the copy now
        return host

    def sync_host_copies(self) -> None:
        """Wait for the asynchronous device-to-host gradient copies of :meth:`_to_grad_device`."""
        if self.host_copies_pending:
            torch.cuda.synchronize()
            self.host_copies_pending = False

    def finish_gradients(self) -> None:
        """Make every unit's ``grad_shard`` final before a step: reduce anything still local
        (stage 1 always, stages 2/3 after ``no_sync`` backward passes) and wait."""
        if self.config.stage == 1:
            for unit in self.units:
                if unit.full_grad is not None:
                    self._launch_reduce(unit)
        elif self.unsynced:
            self._launch_remaining()  # every rank ran the same no_sync backwards: all reduce, in order
        self.unsynced = False
        self.wait_reductions()
        self.sync_host_copies()
        if self.grad_stash is not None:
            self.grad_stash.settle()
        self._reduce_replicas()

    def _reduce_replicas(self) -> None:
        """HSDP: sum each shard's gradient over the ranks holding the same shard (mesh dimensions
        not sharded over), once per step, in unit order on every rank."""
        for unit in self.units:
            if unit.replicate_group is not None and unit.grad_shard is not None and not unit.replicated:
                with profiling.comm_range("replicate_all_reduce"), named(f"HSDP all-reduce of `{unit.key}`"):
                    reducer = unit.reducer or self.reducer
                    wait(reducer.all_reduce(unit.grad_shard, group=unit.replicate_group, key=unit.key))
                unit.replicated = True

    # ---- shard storage (stage 3, ZeRO-Infinity) ------------------------------------------------
    def attach_storage(self, storage: Any) -> int:
        """Keep every sharded unit's compute shard in ``storage`` between gathers.

        Units whose shard is the optimizer's master itself (fp32 masters left on the device, e.g.
        Twin-Flow's kept sub-groups) stay in memory: the optimizer updates that tensor in place.

        Returns:
            The number of units attached.

        Raises:
            ValueError: the engine is not stage 3 (stages 1/2 keep whole parameters resident).
        """
        if self.config.stage != 3:
            raise ValueError(f"parameter offload (a placement's shard_storage) needs ZeroConfig(stage=3), got stage="
                             f"{self.config.stage}; use stage=3 or keep parameters in memory.")
        # unit.master is what the placement returned (its optimizer steps that tensor).
        # Units zero_shard already handed to the storage as they were built keep it.
        units = [unit for unit in self.units if not unit.resident and unit.storage is None and
                 unit.master.untyped_storage().data_ptr() != unit.shard.untyped_storage().data_ptr()]
        if hasattr(storage, "reserve"):  # optional: check the space for every shard up front
            storage.reserve(sum(u.shard_numel * u.shard.element_size() for u in units), len(units))
        for unit in units:
            unit.attach_storage(storage)
        self.storage = storage
        return len(units)

    def attach_grad_storage(self, storage: Any) -> None:
        """Keep reduced gradient shards in ``storage`` between backward and the step (see
        :mod:`plait.zero_sharding.grad_stash`).

        Raises:
            ValueError: the engine is stage 1 (it keeps a full gradient buffer by design).
        """
        if self.config.stage == 1:
            raise ValueError("gradient offload (a placement's grad_storage) needs ZeroConfig(stage=2) or 3, got "
                             "stage=1; use stage 2 or 3, or keep gradients in memory.")
        self.grad_stash = GradStash(storage)

    def forget_grads(self, unit: FlatUnit) -> None:
        """Drop every gradient of ``unit``: in memory and in the gradient storage."""
        if self.grad_stash is not None:
            self.grad_stash.forget(unit)  # first: a failed write still in flight restores grad_shard
        unit.zero_grad()

    def settle_shards(self) -> None:
        """End of a step: wait for every shard write and free the shards (collective with a
        storage: every rank calls it; the storage raises a failure on every rank together)."""
        if self.storage is None:
            return
        errors = [err for unit in self.units if (err := unit.drop_shard(retry=True)) is not None]
        self.storage.finish_step(errors)

    # ---- contexts -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without communication."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    @contextlib.contextmanager
    def gathered(self, writeback: bool) -> Iterator[None]:
        """Every unit gathered and hooks paused; with ``writeback`` edits go back to the masters."""
        self.pinned += 1
        try:
            with profiling.range_("gather_all"):
                # "step" asks the gatherer for exact values: a quantized (ZeRO++) forward gather
                # would hand out rounded weights and, with writeback, round the fp32 masters.
                for unit in self.units:
                    unit.gather(self.gatherer, "step")
            yield
        finally:
            self.pinned -= 1
            if writeback:
                self.write_back(self.units)
            if not self.pinned:
                for unit in self.units:
                    unit.release()

    @torch.no_grad()
    def write_back(self, units: list[FlatUnit]) -> None:
        """Copy edited elements of the gathered ``units`` into shards and masters. Only elements
        that differ from the master's compute-dtype value are written, so untouched fp32 masters
        keep their precision under bf16/fp16 compute.

        Args:
            units: gathered (or resident) units of this engine.
        """
        for unit in units:
            lo, hi = unit.shard_range
            edited = unit.full[lo:hi]
            if not unit.resident:
                unit.writable_shard(read=False).copy_(edited)
                unit.store_shard()
            master = self.placement.masters()[unit.key]
            current = master.detach().to(device=edited.device, dtype=edited.dtype)
            changed = edited != current
            if bool(changed.any()):
                updated = master.detach().to(edited.device, copy=True)
                updated[changed] = edited[changed].float()
                master.copy_(updated)
