"""Whole-tensor optimizer state streamed through an NVMe store, one unit at a time.

With ``zero_placement(OffloadConfig(device="nvme"))`` from plait-offload-io, the owner rank's
whole tensors and their optimizer state (Muon's momentum, Adam's moments, Adafactor's factored
moments) are not kept in memory between steps:

* the whole tensors are placeholders (their shape, 4 bytes of memory): a step fills them from the
  unit's gathered fp32 master, which the flat master shards (in host memory, as with
  ``device="cpu"``) keep exact, so they never need to be stored;
* the optimizer state of a unit's owned tensors is one group of the offload's
  :class:`~plait.offload_io.file_store.FileStateStore` (group id: the unit key); a step reads the
  group into one of the store's slots (the next unit's group is read while this one steps), the
  optimizer steps on views of the slot, and the group is written back and dropped from
  ``optimizer.state``. Host memory holds at most ``OffloadConfig.slots`` groups.

State found in ``optimizer.state`` at a step (loaded by ``load_state_dict``, or brought in for a
reader by :meth:`WholeStateStore.materialize`) is newer than the store's copy: the step uses it
and stores it again, so in-place edits (a sharded checkpoint load) are kept. Numbers in the state
(Adafactor's ``step``) stay in memory.

This module does not import plait-offload-io: the store is used through its method names
(``register``, ``get``, ``put``, ``prefetch``, ``flush``, ``in``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn


def placeholder(shape: torch.Size | tuple[int, ...]) -> Tensor:
    """A tensor of ``shape`` backed by one fp32 element (what a stored whole tensor holds)."""
    return torch.zeros((), dtype=torch.float32).expand(tuple(shape))


class WholeStateStore:
    """The owned tensors' optimizer state of each unit as one store group (see the module docstring).

    Args:
        store: a state store (plait-offload-io's ``FileStateStore`` protocol).
    """

    def __init__(self, store: Any) -> None:
        self.store = store

    def install(self, optimizer: torch.optim.Optimizer, key: str, wholes: Sequence[nn.Parameter]) -> dict | None:
        """Before the step of unit ``key``: point the state of ``wholes`` at the store's copy.

        Args:
            optimizer: the inner optimizer over the owned whole tensors.
            key: the unit key (the store group).
            wholes: the unit's owned whole tensors, in a fixed order.

        Returns:
            The installed slot views, or ``None`` when the state is in memory or not stored yet.
        """
        if key not in self.store or _tensor_state(optimizer, wholes):
            return None
        views = self.store.get(key)
        for name, view in views.items():
            index, state_name = name.split(".", 1)
            optimizer.state[wholes[int(index)]][state_name] = view
        return views

    def release(self, optimizer: torch.optim.Optimizer, key: str, wholes: Sequence[nn.Parameter],
                views: dict | None) -> None:
        """After the step of unit ``key``: write the state back (in place when the optimizer
        updated the installed views, else as a new layout) and drop its tensors from memory.

        Raises:
            OffloadIOError: the store could not take the group (no space): the state stays in
                ``optimizer.state``, so nothing is lost, and the next step stores it again.
        """
        tensors = _tensor_state(optimizer, wholes)
        if views is not None:
            same = tensors.keys() == views.keys() and all(tensors[n] is views[n] for n in views)
            self.store.put(key, dirty=same)
            if not same:
                self.store.register(key, tensors)
        elif tensors:
            self.store.register(key, tensors)
        self.drop(optimizer, wholes)

    def prefetch(self, optimizer: torch.optim.Optimizer, key: str, wholes: Sequence[nn.Parameter]) -> None:
        """Start reading the group of unit ``key`` (the next unit to step), if :meth:`install`
        will use it (stored, and not superseded by state in memory)."""
        if key in self.store and not _tensor_state(optimizer, wholes):
            self.store.prefetch(key)

    def materialize(self, optimizer: torch.optim.Optimizer, groups: dict[str, Sequence[nn.Parameter]]) -> list[str]:
        """Bring every stored group into ``optimizer.state`` as tensors of their own, for readers
        (``state_dict``, sharded checkpoints); the next step stores them again (with in-place
        edits, e.g. a sharded load), unless :meth:`drop` forgets them first.

        Args:
            optimizer: the inner optimizer.
            groups: unit key -> its owned whole tensors (the order of :meth:`install`).

        Returns:
            The keys brought in.
        """
        brought = []
        for key, wholes in groups.items():
            if key not in self.store or _tensor_state(optimizer, wholes):
                continue
            views = self.store.get(key)
            for name, view in views.items():
                index, state_name = name.split(".", 1)
                optimizer.state[wholes[int(index)]][state_name] = view.clone()
            self.store.put(key, dirty=False)
            brought.append(key)
        return brought

    def drop(self, optimizer: torch.optim.Optimizer, wholes: Sequence[nn.Parameter]) -> None:
        """Forget the state tensors of ``wholes`` (the store holds them, unchanged)."""
        for whole in wholes:
            entry = optimizer.state.get(whole)
            for name in [n for n, v in (entry or {}).items() if isinstance(v, Tensor)]:
                del entry[name]

    def flush(self) -> None:
        """Wait for the write-backs (raises the store's error, e.g. disk full)."""
        self.store.flush()


def _tensor_state(optimizer: torch.optim.Optimizer, wholes: Sequence[nn.Parameter]) -> dict[str, Tensor]:
    """The tensors in the state of ``wholes`` under store names ``"<index>.<state name>"``."""
    out = {}
    for index, whole in enumerate(wholes):
        for name, value in optimizer.state.get(whole, {}).items():
            if isinstance(value, Tensor):
                out[f"{index}.{name}"] = value
    return out
