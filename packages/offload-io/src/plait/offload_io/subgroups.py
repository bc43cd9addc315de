"""Sub-groups of an offloaded optimizer: the unit that is read, stepped and written back.

A sub-group is a run of whole parameters of one parameter group, at most
``OffloadConfig.sub_group_size`` elements (a single larger parameter gets a group of its own).
Each has its own instance of the wrapped optimizer over its *masters*: the parameters
themselves when they are fp32 CPU tensors, otherwise fp32 CPU copies (aligned, and pinned when
the parameter is on CUDA so the copies can be asynchronous).

With the NVMe store the fp32 masters live in the store too, under ``"<index>.__master__"``: between
steps a master tensor keeps its identity (the inner optimizer's state is keyed by it) and its
shape, but its data is a zero-stride placeholder of 4 bytes; before the step its data is pointed
at the store's slot, after the step back at the placeholder.
"""

from __future__ import annotations

import torch

from plait.offload_io.buffers import aligned_like
from plait.offload_io.config import OffloadConfig
from plait.offload_io.errors import OffloadDiskFullError, OffloadIOError
from plait.offload_io.master_release import is_placeholder
from plait.offload_io.store import StateStore

MASTER_KEY = "__master__"

# Bytes of state per parameter element, for the up-front disk-space check.
_STATE_MULTIPLIER = {"Adam": 2, "AdamW": 2, "Adagrad": 1, "RMSprop": 1, "Adadelta": 2, "Adamax": 2, "NAdam": 3,
                     "RAdam": 2, "SGD": 1}


def state_bytes_estimate(optimizer_cls: type, kwargs: dict, elements: int, tensors: int, alignment: int) -> int:
    """Bytes of state ``optimizer_cls`` will keep for ``elements`` fp32 parameter elements.

    Args:
        optimizer_cls: the wrapped optimizer class.
        kwargs: its keyword arguments (``amsgrad``, ``momentum``, ``centered`` add buffers).
        elements: parameter elements.
        tensors: parameter tensors (each state tensor is padded to ``alignment``).
        alignment: file alignment.

    Returns:
        The estimate in bytes (unknown optimizers are assumed to keep two buffers like Adam).
    """
    copies = _STATE_MULTIPLIER.get(optimizer_cls.__name__, 2)
    if kwargs.get("amsgrad"):
        copies += 1
    if optimizer_cls.__name__ == "SGD" and not kwargs.get("momentum"):
        copies = 0
    if optimizer_cls.__name__ == "RMSprop":
        copies += bool(kwargs.get("momentum")) + bool(kwargs.get("centered"))
    return copies * (elements * 4 + tensors * alignment) + tensors * 2 * alignment


class SubGroup:
    """Parameters stepped together, with their masters and their own optimizer instance.

    Args:
        sub_id: the store's group id.
        group_index: index of the parameter group the parameters belong to.
        params: the model's parameters.
        masters: what the optimizer steps (``params[i]`` itself, or an fp32 copy).
        inner: the optimizer instance over ``masters``.
        masters_in_store: separate masters live in the store (NVMe) between steps.
        kept: not offloaded (Twin-Flow): state and fp32 masters stay on the parameters' device.
    """

    def __init__(self, sub_id: int, group_index: int, params: list[torch.Tensor], masters: list[torch.Tensor],
                 inner: torch.optim.Optimizer, *, masters_in_store: bool = False, kept: bool = False) -> None:
        self.id = sub_id
        self.kept = kept
        self.group_index = group_index
        self.params = params
        self.masters = masters
        self.inner = inner
        self.on_cuda = any(p.is_cuda for p in params)
        # Per parameter: its master lives in the store between steps.
        self.stored = [masters_in_store and m is not p for m, p in zip(masters, params)]
        self.masters_in_store = any(self.stored)
        self.masters_out = False  # stored masters currently hold placeholders, not values

    def store_all_masters(self) -> None:
        """Keep every master in the store between steps, also masters that are the parameters
        themselves (a ZeRO placement's host masters, which only the optimizer references)."""
        self.stored = [True] * len(self.masters)
        self.masters_in_store = bool(self.masters)

    def separate(self, j: int) -> bool:
        """Whether parameter ``j`` has a separate fp32 master."""
        return self.masters[j] is not self.params[j]

    def has_grads(self) -> bool:
        """Whether any parameter of the group has a gradient (otherwise the step skips it)."""
        return any(p.grad is not None for p in self.params)

    def copy_missing_grads(self, copied: set[int]) -> None:
        """Copy gradients whose hook did not run (set by hand, not by backward) to the masters."""
        for param, master in zip(self.params, self.masters):
            if master is param or id(master) in copied:
                continue
            if param.grad is None:
                master.grad = None
            elif master.grad is None:
                master.grad = param.grad.detach().to(master.device, torch.float32, copy=True)
            else:
                master.grad.copy_(param.grad)

    def zero_master_grads(self, set_to_none: bool) -> None:
        """Clear the host gradient copies."""
        for param, master in zip(self.params, self.masters):
            if master is not param and master.grad is not None:
                if set_to_none:
                    master.grad = None
                else:
                    master.grad.zero_()

    def sync_hyperparameters(self, group: dict) -> None:
        """Copy the user's current group settings (lr changed by a scheduler, ...) to the inner optimizer."""
        inner_group = self.inner.param_groups[0]
        for key, value in group.items():
            if key != "params":
                inner_group[key] = value

    def install_state(self, views: dict[str, torch.Tensor]) -> None:
        """Point the inner optimizer's state (and stored masters) at the store's tensors.

        Names are ``"<index>.<key>"``; key ``__master__`` is a master weight.
        """
        for name, tensor in views.items():
            j, key = name.split(".", 1)
            if key == MASTER_KEY:
                self.masters[int(j)].data = tensor
                self.masters_out = False
            else:
                self.inner.state[self.masters[int(j)]][key] = tensor

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """The inner optimizer's tensor state (and stored masters) under store names."""
        out = {}
        for j, master in enumerate(self.masters):
            if self.stored[j]:
                out[f"{j}.{MASTER_KEY}"] = master.data
            for key, value in self.inner.state.get(master, {}).items():
                if torch.is_tensor(value):
                    out[f"{j}.{key}"] = value
        return out

    def non_tensor_state(self, j: int) -> dict:
        """State entries of parameter ``j`` that are not tensors (kept in memory)."""
        return {k: v for k, v in self.inner.state.get(self.masters[j], {}).items() if not torch.is_tensor(v)}

    def drop_tensor_state(self) -> None:
        """Forget the tensors the store now holds, so only the store keeps them."""
        for j, master in enumerate(self.masters):
            entry = self.inner.state.get(master)
            if entry:
                for key in [k for k, v in entry.items() if torch.is_tensor(v)]:
                    del entry[key]
            if self.stored[j]:
                master.data = torch.zeros((), dtype=master.dtype).expand(master.shape)
                self.masters_out = True

    def take_ownership(self) -> None:
        """Give every state tensor (and master) memory of its own, off the store's slots.

        Used when the store could not take the group (disk full): the group then lives in the
        inner optimizer until the store can, and a slot may be reused meanwhile.
        """
        for j, master in enumerate(self.masters):
            entry = self.inner.state.get(master, {})
            for key, value in list(entry.items()):
                if torch.is_tensor(value):
                    entry[key] = value.clone()
            if self.stored[j]:
                master.data = master.data.clone()

    def copy_back(self) -> None:
        """Copy updated fp32 masters into the model's parameters (cast to their dtype)."""
        for param, master in zip(self.params, self.masters):
            if master is not param and param.grad is not None:
                param.data.copy_(master, non_blocking=param.is_cuda)

    def load_master(self, j: int, saved: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Set master ``j`` from a saved fp32 tensor, or from its parameter when none was saved.

        Returns:
            ``{"<j>.__master__": value}`` when masters live in the store (the caller registers
            it), else ``{}`` (the master was updated in place).
        """
        master, param = self.masters[j], self.params[j]
        if master is param:
            return {}
        value = saved if saved is not None else param.detach()
        if self.masters_in_store:
            return {f"{j}.{MASTER_KEY}": value.detach().to("cpu", torch.float32, copy=True).view(master.shape)}
        master.copy_(value)
        return {}


class MasterPiece(SubGroup):
    """Elements ``[start, end)`` of one flat fp32 master that is larger than ``sub_group_size``:
    a sub-group of its own, so the NVMe store's slots are bounded by the setting, not by the
    largest master (a ZeRO rank's embedding or output-head shard).

    The optimizer keys its state by the master tensor, so only one piece of a master can be
    installed at a time: during its step the master's ``.data`` and its state entries are the
    piece's slot views (shape ``(end - start,)``; the update is elementwise, so stepping the
    pieces one after another equals stepping the whole master). Between steps the master holds
    the placeholder of its full shape. State the store could not take (disk full) is kept in
    :attr:`own`, not in the optimizer, where the next piece would overwrite it.

    Args:
        sub_id: the store's group id.
        group_index: index of the parameter group.
        master: the whole master (the optimizer's parameter; nothing else references it).
        inner: the optimizer over it.
        start: first element of the piece.
        end: one past its last element.
    """

    def __init__(self, sub_id: int, group_index: int, master: torch.Tensor, inner: torch.optim.Optimizer,
                 start: int, end: int) -> None:
        super().__init__(sub_id, group_index, [master], [master], inner)
        self.start, self.end = start, end
        self.full_shape = master.shape
        self.full_numel = master.numel()
        self.installed = False
        self.own: dict[str, torch.Tensor] | None = None
        self.store_all_masters()

    @property
    def numel(self) -> int:
        """Elements of the piece."""
        return self.end - self.start

    @property
    def last(self) -> bool:
        """Whether this is the master's last piece (the master is fully updated after its step)."""
        return self.end == self.full_numel

    def install_state(self, views: dict[str, torch.Tensor]) -> None:
        """Make the master and its state entries the piece's tensors (slot views or :attr:`own`)."""
        master = self.masters[0]
        entry = self.inner.state[master]
        for key in [k for k, v in entry.items() if torch.is_tensor(v)]:
            del entry[key]
        for name, tensor in views.items():
            key = name.split(".", 1)[1]
            if key == MASTER_KEY:
                master.data = tensor
            else:
                entry[key] = tensor
        self.installed, self.masters_out = True, False

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """The piece's state under store names: the installed tensors, :attr:`own`, or slices of
        the whole master and its state while those are in memory (:meth:`whole_in_memory`)."""
        if self.own is not None:
            return dict(self.own)
        if self.installed:
            return super().tensor_state()
        if not self.whole_in_memory():
            return {}
        master = self.masters[0]
        out = {f"0.{MASTER_KEY}": master.data.view(-1)[self.start:self.end]}
        for key, value in self.inner.state.get(master, {}).items():
            if torch.is_tensor(value):
                out[f"0.{key}"] = self._slice(value)
        return out

    def whole_in_memory(self) -> bool:
        """Whether the master holds its full value (assembled for a reader, or never stored)."""
        master = self.masters[0]
        return not self.installed and master.numel() == self.full_numel and master.stride() != (0,) * master.dim()

    def _slice(self, value: torch.Tensor) -> torch.Tensor:
        # Elementwise state has the master's shape; anything else (a step counter) is per piece.
        return value.view(-1)[self.start:self.end] if value.numel() == self.full_numel else value

    def drop_tensor_state(self) -> None:
        """Forget the piece's tensors (the store holds them): the master gets its placeholder back."""
        master = self.masters[0]
        entry = self.inner.state.get(master)
        if entry:
            for key in [k for k, v in entry.items() if torch.is_tensor(v)]:
                del entry[key]
        master.data = torch.zeros((), dtype=master.dtype).expand(self.full_shape)
        self.installed, self.own, self.masters_out = False, None, True

    def take_ownership(self) -> None:
        """Keep the installed state in :attr:`own` (clones, off the slot), out of the optimizer."""
        own = {name: tensor.clone() for name, tensor in self.tensor_state().items()}
        self.drop_tensor_state()
        self.own = own

    def copy_back(self) -> None:
        """Nothing to copy: a piece's master is the optimizer's own parameter."""


def build_subgroups(params: list[torch.Tensor], group_index: int, start_id: int, config: OffloadConfig,
                    optimizer_cls: type, optim_kwargs: dict, *, split: bool = False) -> list[SubGroup]:
    """Cut one parameter group into sub-groups of at most ``config.sub_group_size`` elements.

    Args:
        params: the group's parameters, in order.
        group_index: the group's index.
        start_id: the first sub-group id to use.
        config: the offload settings (``sub_group_size``, ``master_weights``).
        optimizer_cls: the optimizer to instantiate per sub-group.
        optim_kwargs: its keyword arguments.
        split: a parameter larger than ``sub_group_size`` becomes several :class:`MasterPiece`
            sub-groups of at most that size (the ZeRO placement on NVMe, whose parameters are
            flat fp32 master shards that only the optimizer references); otherwise it gets a
            sub-group of its own, whatever its size.

    Returns:
        The sub-groups.

    Raises:
        ValueError: ``master_weights="off"`` with a parameter that is not fp32 on the CPU.
    """
    limit = config.sub_group_size
    chunks: list[list[torch.Tensor] | tuple[torch.Tensor, int, int]] = []
    size = 0
    for param in params:
        if split and param.numel() > limit:
            chunks += [(param, start, min(start + limit, param.numel())) for start in range(0, param.numel(), limit)]
            size = limit  # the next parameter starts a new sub-group
            continue
        if not chunks or isinstance(chunks[-1], tuple) or size + param.numel() > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(param)
        size += param.numel()
    total = sum(p.numel() for p in params)
    subgroups, offloaded = [], 0
    kept_piece: dict[int, bool] = {}  # every piece of one parameter is kept, or none is
    for i, chunk in enumerate(chunks):
        if isinstance(chunk, tuple):
            param, start, end = chunk
            # Twin-Flow: whole sub-groups from the front are offloaded up to the ratio; the first
            # one always is, so a ratio below one sub-group still offloads something.
            kept = kept_piece.setdefault(id(param), i > 0 and offloaded + param.numel() > config.offload_ratio * total)
            offloaded += 0 if kept else end - start
            if kept and start == 0:
                subgroups.append(_make_subgroup(start_id + len(subgroups), group_index, [param], config,
                                                optimizer_cls, optim_kwargs, True))
            elif not kept:
                subgroups.append(_make_piece(start_id + len(subgroups), group_index, param, start, end, config,
                                             optimizer_cls, optim_kwargs))
            continue
        elements = sum(p.numel() for p in chunk)
        kept = i > 0 and offloaded + elements > config.offload_ratio * total
        offloaded += 0 if kept else elements
        subgroups.append(_make_subgroup(start_id + len(subgroups), group_index, chunk, config, optimizer_cls,
                                        optim_kwargs, kept))
    return subgroups


def _make_piece(sub_id: int, group_index: int, param: torch.Tensor, start: int, end: int, config: OffloadConfig,
                optimizer_cls: type, optim_kwargs: dict) -> MasterPiece:
    # a released master (plait.offload_io.master_release) is a placeholder until the store takes it
    dense = param.is_contiguous() or is_placeholder(param)
    if param.dtype != torch.float32 or param.device.type != "cpu" or not dense:
        raise ValueError(f"OffloadConfig.sub_group_size={config.sub_group_size} splits a parameter of "
                         f"{param.numel()} elements, which needs a contiguous fp32 CPU master (got {param.dtype} "
                         f"on {param.device}); raise sub_group_size above {param.numel()}.")
    return MasterPiece(sub_id, group_index, param, optimizer_cls([param], **optim_kwargs), start, end)


def _make_subgroup(sub_id: int, group_index: int, params: list[torch.Tensor], config: OffloadConfig,
                   optimizer_cls: type, optim_kwargs: dict, kept: bool) -> SubGroup:
    masters = []
    for param in params:
        native = param.dtype == torch.float32 and (kept or param.device.type == "cpu")
        if config.master_weights == "off" and not native:
            raise ValueError(f"OffloadConfig.master_weights='off' needs fp32 CPU parameters, got {param.dtype} on "
                             f"{param.device}; use master_weights='auto'.")
        if native and config.master_weights != "on":
            masters.append(param)
            continue
        if kept:
            master = param.detach().to(torch.float32, copy=True)  # on the parameter's device
        else:
            master = aligned_like(param.detach().float(), pinned=param.is_cuda)
            master.copy_(param.detach())
        masters.append(master)
    return SubGroup(sub_id, group_index, params, masters, optimizer_cls(masters, **optim_kwargs),
                    masters_in_store=config.device == "nvme" and not kept, kept=kept)


def write_back_state(store: StateStore, sg: SubGroup, views: dict[str, torch.Tensor] | None, held: set,
                     errors: list[OffloadIOError]) -> None:
    """Put a sub-group's optimizer state back into ``store`` after its step.

    Args:
        store: where the state lives between steps.
        sg: the sub-group that just stepped.
        views: the store's views the state was installed from, or ``None`` when it was not in
            the store (first step, or held in memory after a disk-full error).
        held: ids of sub-groups whose only copy is in memory; updated here.
        errors: a disk-full error is appended here (the caller agrees on it across ranks) and
            the state is kept in memory until ``flush()``.
    """
    current = sg.tensor_state()
    if views is not None and store.layout(sg.id).matches(current):
        for name, tensor in current.items():
            if tensor.data_ptr() != views[name].data_ptr():  # replaced instead of updated in place
                views[name].copy_(tensor)
        sg.drop_tensor_state()
        store.put(sg.id)
        return
    # First step of this sub-group, new state appeared (a parameter got its first grad), or the
    # state was held in memory after a disk-full error: (re-)register it.
    if views is not None:
        store.put(sg.id, dirty=False)
    try:
        store.register(sg.id, current)
    except OffloadDiskFullError as exc:
        sg.take_ownership()  # the slot it viewed may be reused; keep the only copy until flush()
        held.add(sg.id)
        errors.append(exc)
        return
    held.discard(sg.id)
    sg.drop_tensor_state()


def read_ahead(store: StateStore, subgroups: list[SubGroup], slots: int, stored) -> list:
    """Start reading the first offloaded sub-groups' state before the step needs it (during
    backward), leaving one slot for the step's own read-ahead and one for a write-back.

    Args:
        store: the state store.
        subgroups: all sub-groups, in step order.
        slots: the store's slot count.
        stored: ``stored(sg)`` says whether the sub-group's state is in the store.

    Returns:
        The ids whose reads were started (give them to :func:`release_unread`).
    """
    ids = [sg.id for sg in subgroups if not sg.kept and stored(sg)][:max(1, slots - 2)]
    for gid in ids:
        store.prefetch(gid)
    return ids


def release_unread(store: StateStore, started: list, stepped: set) -> None:
    """Return groups :func:`read_ahead` started that the step did not use (no gradient), so their
    slots can be reused: a prefetched slot is otherwise held until its ``get``."""
    for gid in started:
        if gid not in stepped and gid in store:
            store.get(gid)
            store.put(gid, dirty=False)

