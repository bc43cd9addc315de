"""ZeRO-Offload through plait-zero-sharding's ``StatePlacement`` extension point.

``zero_shard(model, torch.optim.AdamW, config, placement=zero_placement(OffloadConfig(...)))``
hands this placement every fp32 master shard of the rank. It keeps a separate fp32 copy of each
in host memory (page-locked when the shard is on CUDA) and builds the user's optimizer over those
copies, so the optimizer state (Adam moments, step counters) is created and updated on the CPU:

* ``device="cpu"``: masters and state stay in CPU memory between steps (ZeRO-Offload);
* ``device="nvme"``: the state of each sub-group lives in a file of a
  :class:`~plait.offload_io.file_store.FileStateStore`; a step reads the next sub-group while the
  current one steps and writes the previous one back (double buffering, ZeRO-Infinity's optimizer
  part). The fp32 masters live in the same files (entry ``"<i>.__master__"`` of each sub-group):
  between steps a master keeps its identity and shape but holds a 4-byte placeholder. The engine
  refreshes each unit's compute shard from its master during the step, while the sub-group is in
  memory (the ``ready`` callback); outside readers of :meth:`masters` (checkpoints,
  ``gathered_parameters(writeback=True)``) bring the sub-group into memory first.
* ``param_device="cpu"/"nvme"`` (stage 3): :meth:`ZeroOffloadPlacement.shard_storage` also keeps
  the compute-dtype parameter shards in host memory or files between gathers (ZeRO-Infinity's
  parameter offload, see :mod:`plait.offload_io.shard_storage`).

The step runs per sub-group (``OffloadConfig.sub_group_size`` elements of whole shards): gradients
are copied to the host, the one inner optimizer steps only that sub-group (torch optimizers skip
parameters without ``.grad``), and with ``offload_ratio`` < 1 the trailing sub-groups keep their
masters where ZeRO built them and step there (Twin-Flow). The updates are elementwise, so on the
CPU the result is bitwise what :class:`plait.zero_sharding.extension.LocalPlacement` gives.

This module does not import plait.zero_sharding: it implements the protocol by its method names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from plait.offload_io import probe
from plait.offload_io.agreement import raise_together
from plait.offload_io.budget import fit_model
from plait.offload_io.buffers import aligned_like
from plait.offload_io.config import OffloadConfig
from plait.offload_io.engine import AsyncIOEngine
from plait.offload_io.errors import OffloadIOError
from plait.offload_io.file_store import FileStateStore
from plait.offload_io.master_pieces import read_pieces, store_whole
from plait.offload_io.master_release import ReleasedMasters
from plait.offload_io.shard_storage import CpuShardStorage, FileShardStorage
from plait.offload_io.state_swapping import MaterializingMasters, StateSwapping, SwappingState
from plait.offload_io.subgroups import (
    MASTER_KEY,
    MasterPiece,
    SubGroup,
    build_subgroups,
    read_ahead,
    release_unread,
    state_bytes_estimate,
    write_back_state,
)


class ZeroOffloadPlacement(StateSwapping):
    """A plait.zero_sharding ``StatePlacement`` that offloads masters and optimizer state.

    Args:
        config: where the state goes (``device``, ``path``, ``sub_group_size``, ``slots``,
            ``offload_ratio``, ``io``). ``master_weights`` is not consulted: ZeRO's masters are
            always fp32, and an offloaded master is always a separate host copy.

    Raises:
        TypeError: ``config`` is not an :class:`OffloadConfig`.

    Example::

        placement = zero_placement(OffloadConfig(device="nvme", path="/local_nvme/offload"))
        model, opt = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, lr=1e-3)
    """

    def __init__(self, config: OffloadConfig) -> None:
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"ZeroOffloadPlacement(config=...) needs a plait.offload_io.OffloadConfig, got "
                            f"{type(config).__name__}; e.g. OffloadConfig(device='cpu').")
        self.config = config
        self.store: FileStateStore | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._masters: dict[str, nn.Parameter] = {}
        self._origin: dict[str, Tensor] = {}  # ZeRO's own masters, until make_optimizer decides
        self._key_of: dict[int, str] = {}
        self._subgroups: list[SubGroup] = []
        # Sub-groups whose state is in the optimizer's memory, not (only) in the store: after a failed
        # write (disk full), or swapped in for a reader of optimizer.state; the next step stores them.
        self._held: set[int] = set()
        self._subgroup_of: dict[int, SubGroup] = {}  # id(master) -> its sub-group (masters not split)
        self._pieces: dict[int, list[MasterPiece]] = {}  # id(master) -> its pieces (masters split)
        self._depth = 0
        self._stepping: SubGroup | None = None  # the sub-group whose store slot is installed
        self._shard_storage: CpuShardStorage | FileShardStorage | None = None
        self._grad_storage: FileShardStorage | None = None
        self._whole_store: FileStateStore | None = None  # whole-tensor optimizers' state (whole_tensor_store)
        self._engine: AsyncIOEngine | None = None
        self._early: list[int] | None = None  # sub-groups whose reads this backward started
        self._released: ReleasedMasters | None = None  # masters handed over unit by unit (release_master)

    def backward_started(self) -> None:
        """Called by plait-zero-sharding when a backward begins: with ``device="nvme"`` and
        ``overlap_io``, start reading the first sub-groups' state so the read overlaps backward."""
        if self._early is None and self.store is not None and self.config.overlap_io:
            with self._internal():
                self._early = read_ahead(self.store, self._subgroups, self.config.slots, self._from_store)

    @property
    def grad_device(self) -> torch.device:
        """Where plait-zero-sharding keeps reduced gradient slices: host memory, where the masters
        step. The engine copies each slice there as soon as its reduce-scatter is done (page-locked,
        asynchronous, overlapping the rest of backward); on a CPU-only machine nothing moves."""
        return torch.device("cpu")

    @property
    def offloads_parameters(self) -> bool:
        """Whether stage-3 parameter shards are offloaded too (``OffloadConfig.param_device``)."""
        return self.config.param_device != "none"

    def check_model(self, model: nn.Module, world_size: int) -> None:
        """With ``OffloadConfig.memory_budget``: decide where gradients wait for the step and refuse
        a budget the model cannot fit, before ``zero_shard`` does any work (an optional member of
        the placement protocol, called with the model and the sharding world size).

        Raises:
            ValueError: the budget cannot hold the model; names the smallest budget that would.
        """
        if self.config.memory_plan is not None:
            self.config = fit_model(self.config, model, world_size)

    @property
    def releases_masters(self) -> bool:
        """Whether ``zero_shard`` may hand each unit over as soon as it is built
        (:meth:`release_master`): parameters and state on NVMe, nothing kept on the device
        (``offload_ratio=1``), so no master needs ZeRO's own tensor after the optimizer exists."""
        config = self.config
        return config.device == "nvme" and config.param_device == "nvme" and config.offload_ratio >= 1.0

    def release_master(self, key: str, *, stored_as: str | None) -> None:
        """Drop the values of the placed master of ``key`` until :meth:`make_optimizer` stores them
        (an optional member of the placement protocol, called only when :attr:`releases_masters`;
        see :mod:`plait.offload_io.master_release`).

        Args:
            key: the unit key given to :meth:`place_master`.
            stored_as: the parameter-storage key that already holds exactly the master's values
                (the unit's fp32 compute shard), or ``None`` to write them there now.

        Raises:
            ValueError: :attr:`releases_masters` is false, or ``key`` was never placed.
        """
        if not self.releases_masters or key not in self._masters:
            raise ValueError(f"release_master({key!r}): needs a placed master and OffloadConfig(device='nvme', "
                             "param_device='nvme', offload_ratio=1.0); place it with place_master first.")
        if self._released is None:
            self._released = ReleasedMasters(self.shard_storage())
        self._origin.pop(key, None)  # ZeRO's tensor: nothing may keep it alive
        self._released.release(key, self._masters[key], stored_as=stored_as)

    # -- the protocol -------------------------------------------------------------------------
    def place_master(self, key: str, master: Tensor) -> Tensor:
        """Return a host fp32 copy of ``master`` (a new ``nn.Parameter``) for the optimizer.

        Args:
            key: the unit key.
            master: ZeRO's fp32 master shard on the compute device.

        Returns:
            The placed master (``optimizer.state`` is keyed by it).
        """
        if self.config.device == "nvme" and master.device.type == "cpu" and master.dtype == torch.float32:
            # No host copy: make_optimizer copies the values into the store's files and leaves
            # the placed master a placeholder, so a rank never holds its masters twice.
            host = master.detach()
        else:
            host = aligned_like(master.detach().float(), pinned=master.is_cuda)
            host.copy_(master.detach())
        placed = nn.Parameter(host, requires_grad=True)
        self._origin[key] = master
        self._masters[key] = placed
        self._key_of[id(placed)] = key
        return placed

    def make_optimizer(self, build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                       param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """Build the user's optimizer over the placed masters and cut them into sub-groups.

        Args:
            build: constructs the user's optimizer class with the user's options.
            param_groups: groups referencing the placed masters.

        Returns:
            The inner optimizer (its ``state_dict``/``load_state_dict`` swap NVMe state in).

        Raises:
            OffloadDiskFullError: ``device="nvme"`` and the directory lacks room for the state.
        """
        inner = build(param_groups)
        _prefer_fused(inner)
        # Sub-groups reuse the single-process optimizer's chunking and Twin-Flow split; every
        # sub-group shares the one inner optimizer (its param_groups are what schedulers see).
        chunking = dataclasses.replace(self.config, master_weights="auto")
        # On NVMe a master larger than sub_group_size is split into pieces, so the store's slots are
        # bounded by the setting and not by the largest unit (the embedding or head shard).
        split = self.config.device == "nvme"
        for index, group in enumerate(inner.param_groups):
            self._subgroups += build_subgroups(group["params"], index, len(self._subgroups), chunking,
                                               lambda _masters, **_kw: inner, {}, split=split)
        for sg in self._subgroups:
            if sg.kept:
                for master in sg.masters:  # Twin-Flow: back onto ZeRO's own (compute device) master
                    master.data = self._origin[self._key_of[id(master)]].detach()
        self._origin.clear()
        self._subgroup_of = {id(m): sg for sg in self._subgroups
                             if not sg.kept and not isinstance(sg, MasterPiece) for m in sg.masters}
        for sg in self._subgroups:
            if isinstance(sg, MasterPiece):
                self._pieces.setdefault(id(sg.masters[0]), []).append(sg)
        if self.config.device == "nvme":
            for sg in self._subgroups:
                if not sg.kept:
                    sg.store_all_masters()
            self.store = self._make_store(inner)
            weakref.finalize(self, self.store.close)
            self._store_masters()
            inner.register_state_dict_pre_hook(lambda _opt: self._swap_in())
            inner.register_state_dict_post_hook(self._after_state_dict)
            inner.register_load_state_dict_post_hook(self._after_load)
            inner.state = SwappingState(self, inner.state)
        self.optimizer = inner
        return inner

    def step(self, optimizer: torch.optim.Optimizer, grads: Mapping[str, Tensor],
             ready: Callable[[str], None] | None = None) -> None:
        """Step every sub-group that has a gradient, streaming NVMe state through the store.

        Args:
            optimizer: the inner optimizer from :meth:`make_optimizer`.
            grads: unit key -> fp32 gradient shard on the compute device.
            ready: called with each stepped key while its master is in memory (the engine
                refreshes the compute shard from it then, see the ``StatePlacement`` protocol).

        Raises:
            OffloadDiskFullError: some state could not be written (raised on every rank of the
                world together, so none is left waiting in a collective). The step was applied
                and the state is kept in memory; training may go on, or call :meth:`flush`.
        """
        errors: list[OffloadIOError] = []
        with torch.no_grad(), self._internal():
            # Split masters a reader brought into memory whole go back into their pieces first:
            # a piece steps from its own slot.
            for pieces in self._pieces.values():
                if pieces[0].whole_in_memory():
                    store_whole(self.store, pieces, self._held, errors)
            # Kept sub-groups first: on a GPU their step is queued and runs while the CPU steps.
            todo = sorted((sg for sg in self._subgroups if any(self._key_of[id(m)] in grads for m in sg.masters)),
                          key=lambda sg: not sg.kept)
            stored = [sg.id for sg in todo if self._from_store(sg)]
            if stored:
                self.store.prefetch(stored[0])
            upcoming = self._start_grads(todo[0], grads) if todo else {}
            for i, sg in enumerate(todo):
                following = [gid for gid in stored if gid > sg.id]
                if following:
                    self.store.prefetch(following[0])  # read the next one while this one steps
                current = upcoming
                if i + 1 < len(todo):  # gradients on disk: the next sub-group's read runs meanwhile too
                    upcoming = self._start_grads(todo[i + 1], grads)
                self._step_subgroup(optimizer, sg, current, errors, ready)
            if self.store is not None:
                release_unread(self.store, self._early or [], {sg.id for sg in todo})
            self._early = None
            if self.store is not None and self.config.overlap_io:
                errors += self.store.take_errors()  # the last write-backs run on into the next forward
            elif self.store is not None:
                try:
                    self.store.flush()
                except OffloadIOError as exc:
                    errors.append(exc)
        if self.store is not None:
            raise_together(errors, what="offloaded optimizer state", path=self.config.path)

    def read_master(self, key: str, out: Tensor) -> None:
        """Copy (casting, host to device) the master of ``key`` into ``out``; an NVMe master not
        in memory is read from its sub-group's file (without holding the sub-group)."""
        master = self._masters[key]
        pieces = self._pieces.get(id(master))
        if pieces is not None and not pieces[0].whole_in_memory():
            with self._internal():
                read_pieces(self.store, pieces, out, self._stepping)
            return
        sg = self._subgroup_of.get(id(master))
        if sg is not None and sg is not self._stepping and sg.masters_out and self._from_store(sg):
            with self._internal():
                views = self.store.get(sg.id)
                j = next(j for j, m in enumerate(sg.masters) if m is master)
                out.copy_(views[f"{j}.{MASTER_KEY}"])
                self.store.put(sg.id, dirty=False)
            return
        if out.data_ptr() != master.data_ptr():
            out.copy_(master, non_blocking=out.is_cuda and master.is_pinned())

    def masters(self) -> Mapping[str, Tensor]:
        """Unit key -> placed master (host fp32; ZeRO's own for Twin-Flow kept sub-groups).

        With ``device="nvme"`` looking a master up brings its sub-group (master and state) into
        memory until the next step, which stores it again, so reads and in-place edits are safe.
        """
        return MaterializingMasters(self)

    def shard_storage(self) -> CpuShardStorage | FileShardStorage | None:
        """Where plait-zero-sharding keeps stage-3 parameter shards (``OffloadConfig.param_device``).

        Returns:
            ``None`` for ``param_device="none"``; else the storage (one per placement, closed by
            :meth:`close`).
        """
        if self.config.param_device == "none":
            return None
        if self._shard_storage is None:
            if self.config.param_device == "cpu":
                self._shard_storage = CpuShardStorage()
            else:
                self._shard_storage = FileShardStorage(self.config.path, engine=self._io_engine())
                weakref.finalize(self, self._shard_storage.close)
        return self._shard_storage

    def whole_tensor_store(self) -> FileStateStore:
        """The NVMe store plait-zero-sharding's whole-tensor placement (Muon, LAMB...) keeps the
        owned tensors' optimizer state in, one group per unit (``device="nvme"``; this placement's
        own sub-groups are then unused). One per placement, closed by :meth:`close`.

        Returns:
            A :class:`FileStateStore` under ``OffloadConfig.path`` with ``OffloadConfig.slots`` slots.

        Raises:
            ValueError: ``OffloadConfig.device`` is not ``"nvme"``.
        """
        if self.config.device != "nvme":
            raise ValueError(f"whole_tensor_store() needs OffloadConfig(device='nvme'), got "
                             f"device={self.config.device!r}.")
        if self._whole_store is None:
            self._whole_store = FileStateStore(self.config.path, engine=self._io_engine(), slots=self.config.slots,
                                               close_engine=False)
            weakref.finalize(self, self._whole_store.close)
        return self._whole_store

    def grad_storage(self) -> FileShardStorage | None:
        """Where plait-zero-sharding keeps reduced gradient shards until the step
        (``OffloadConfig.grad_device``).

        Returns:
            ``None`` for ``grad_device="cpu"``; else the file storage (closed by :meth:`close`).
        """
        if self.config.grad_device != "nvme":
            return None
        if self._grad_storage is None:
            self._grad_storage = FileShardStorage(self.config.path, engine=self._io_engine(), kind="grads")
            weakref.finalize(self, self._grad_storage.close)
            elements = sum(m.numel() for m in self._masters.values())
            self._grad_storage.reserve(elements * 4, len(self._masters))
        return self._grad_storage

    # -- beyond the protocol ------------------------------------------------------------------
    @contextlib.contextmanager
    def materialized(self) -> Iterator[None]:
        """Inside, ``optimizer.state`` holds every NVMe-resident tensor in memory; on exit it is
        written back to the store (so edits made inside, e.g. a sharded checkpoint load, persist).

        Use it around code that reads ``optimizer.inner.state`` directly, such as
        ``ZeroModule.sharded_state_dict()``. A no-op with ``device="cpu"``.
        """
        self._swap_in()
        try:
            yield
        finally:
            self._swap_out(write=True)

    def flush(self) -> None:
        """Write state held in memory after a disk-full error, once space is back.

        Raises:
            OffloadDiskFullError: still no space; the state stays in memory.
        """
        with self._internal():
            for pieces in self._pieces.values():
                if pieces[0].whole_in_memory():
                    store_whole(self.store, pieces, self._held, None)
            for sg in self._subgroups:
                if sg.id in self._held:
                    self.store.register(sg.id, sg.tensor_state())
                    self._held.discard(sg.id)
                    sg.drop_tensor_state()
            if self.store is not None:
                self.store.flush()

    @property
    def offloaded_elements(self) -> int:
        """Master elements whose state is offloaded (the rest are Twin-Flow kept)."""
        return sum(sg.numel if isinstance(sg, MasterPiece) else sum(m.numel() for m in sg.masters)
                   for sg in self._subgroups if not sg.kept)

    def close(self) -> None:
        """Close the NVMe store and the parameter storage (deletes their files). Idempotent."""
        if self.store is not None:
            self.store.close()
        if self._shard_storage is not None:
            self._shard_storage.close()
        if self._grad_storage is not None:
            self._grad_storage.close()
        if self._whole_store is not None:
            self._whole_store.close()
        if self._engine is not None:
            self._engine.close()

    def _io_engine(self) -> AsyncIOEngine:
        """The one I/O engine (threads, bounce buffers) the state store and the shard files share."""
        if self._engine is None:
            self._engine = AsyncIOEngine(self.config.io)
            weakref.finalize(self, self._engine.close)
        return self._engine

    # -- internals ----------------------------------------------------------------------------
    def _make_store(self, inner: torch.optim.Optimizer) -> FileStateStore:
        config = self.config
        store = FileStateStore(config.path, engine=self._io_engine(), slots=config.slots, close_engine=False)
        offloaded = list({id(m): m for sg in self._subgroups if not sg.kept for m in sg.masters}.values())
        elements = sum(m.numel() for m in offloaded)
        planned = state_bytes_estimate(type(inner), inner.defaults, elements, len(offloaded), config.io.alignment)
        planned += elements * 4 + len(offloaded) * config.io.alignment  # the fp32 masters
        try:
            probe.check_space(store.directory + "/state", planned, min_free_bytes=config.io.min_free_bytes,
                              what=f"ZeRO optimizer state of {len(offloaded)} shards ({type(inner).__name__})")
        except OffloadIOError:
            store.close()
            raise
        return store

    def _store_masters(self) -> None:
        """Move every offloaded sub-group's masters into the store (they have no state yet)."""
        released = self._released
        with self._internal():
            offloaded = [sg for sg in self._subgroups if not sg.kept]
            waiting: list[SubGroup] = []
            for i, sg in enumerate(offloaded):
                if released is not None:
                    released.load(sg.masters)  # a released master's values, one sub-group at a time
                self.store.register(sg.id, sg.tensor_state())
                waiting.append(sg)
                later = offloaded[i + 1].masters if i + 1 < len(offloaded) else []
                if released is None and later:
                    continue  # every master is in memory anyway: drop them all at the end
                if not any(m is n for m in sg.masters for n in later):
                    # every piece of a split master took its slice: its memory may go
                    for done in waiting:
                        done.drop_tensor_state()
                        if released is not None:
                            released.forget(done.masters)
                    waiting = []
            self.store.flush()

    def _from_store(self, sg: SubGroup) -> bool:
        return self.store is not None and sg.id in self.store and sg.id not in self._held

    def _start_grads(self, sg: SubGroup, grads: Mapping[str, Any]) -> dict[int, Any]:
        """id(master) -> the sub-group's range of its gradient: a tensor view, or (gradients in
        the storage, ``grad_device="nvme"``) a read already started that :func:`_grad_range`
        finishes."""
        out = {}
        for master in sg.masters:
            grad = grads.get(self._key_of[id(master)])
            if grad is None:
                continue
            start, end = (sg.start, sg.end) if isinstance(sg, MasterPiece) else (0, master.numel())
            out[id(master)] = grad.start_read(start, end) if callable(getattr(grad, "start_read", None)) \
                else _grad_range(grad, start, end)
        return out

    def _step_subgroup(self, optimizer: torch.optim.Optimizer, sg: SubGroup, grads: dict[int, Any],
                       errors: list[OffloadIOError], ready: Callable[[str], None] | None) -> None:
        piece = isinstance(sg, MasterPiece)
        views = self.store.get(sg.id) if self._from_store(sg) else None
        if views is not None:
            sg.install_state(views)
        elif piece:
            sg.install_state(sg.own)  # held in memory after a failed write
        for master in sg.masters:
            grad = grads.get(id(master))
            if callable(grad):
                grad = grad()  # a read started by _start_grads
            master.grad = None if grad is None else grad.to(master.device)
        optimizer.step()  # parameters without .grad (other sub-groups) are skipped
        self._stepping = sg
        try:
            for master in sg.masters:
                master.grad = None
                if ready is not None and (not piece or sg.last):
                    ready(self._key_of[id(master)])  # the master is in memory now: refresh the shard
        finally:
            self._stepping = None
        if self.store is None or sg.kept:
            return
        write_back_state(self.store, sg, views, self._held, errors)

def _grad_range(grad: Any, start: int, end: int) -> Tensor:
    """Elements ``[start, end)`` of a gradient shard: a view of a tensor, or read from the
    gradient storage (plait-zero-sharding's ``StashedGrad``, ``OffloadConfig.grad_device="nvme"``)."""
    if torch.is_tensor(grad):
        return grad if start == 0 and end == grad.numel() else grad.reshape(-1)[start:end]
    return grad.read(start, end)


def _prefer_fused(inner: torch.optim.Optimizer) -> None:
    """Adam/AdamW built without ``fused``/``foreach``: step with torch's fused kernel, measured the
    fastest correct CPU implementation (3-5x the foreach default on tiny-llama; README, "CPU
    step"). The choice is per parameter group in torch, so setting it after construction is the
    same as passing ``fused=True``; a user's explicit ``fused``/``foreach`` is kept."""
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    if inner.defaults.get("fused") is not None or inner.defaults.get("foreach") is not None:
        return
    if inner.defaults.get("differentiable") or inner.defaults.get("capturable"):
        return  # fused does not combine with these
    inner.defaults["fused"] = True
    for group in inner.param_groups:
        group["fused"] = True


def zero_placement(config: OffloadConfig) -> ZeroOffloadPlacement:
    """The placement to pass as ``zero_shard(..., placement=...)``.

    Args:
        config: where the optimizer state goes.

    Returns:
        A fresh :class:`ZeroOffloadPlacement` (one per model; it is stateful).

    Raises:
        TypeError: ``config`` is not an :class:`OffloadConfig`.
    """
    return ZeroOffloadPlacement(config)


__all__ = ["ZeroOffloadPlacement", "zero_placement"]
