"""Swapping NVMe-resident optimizer state in and out for readers outside the step.

Between steps, ``OffloadConfig(device="nvme")`` keeps each sub-group's masters and optimizer state
in the files of a :class:`~plait.offload_io.file_store.FileStateStore`, leaving empty entries and
placeholders in the optimizer. Readers outside the placement (``optimizer.state_dict()``,
``load_state_dict``, a sharded checkpoint reading ``optimizer.state[master]``, a consolidated
checkpoint reading the masters) must see real tensors. :class:`StateSwapping` is the part of
:class:`~plait.offload_io.zero_placement.ZeroOffloadPlacement` that brings a sub-group into memory
for such a reader and stores it again afterwards; :class:`SwappingState` and
:class:`MaterializingMasters` are the views that trigger it on access.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from plait.offload_io.master_pieces import assemble, drop_whole, store_whole
from plait.offload_io.subgroups import MASTER_KEY, MasterPiece


class StateSwapping:
    """Mixin of :class:`~plait.offload_io.zero_placement.ZeroOffloadPlacement`: swapping state in
    and out around outside readers. It uses the placement's ``store``, ``_subgroups``,
    ``_subgroup_of``, ``_pieces``, ``_held`` and ``_depth``; ``_from_store`` says whether a
    sub-group's state lives in the store."""

    def _after_state_dict(self, _optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        # torch's state_dict shares the per-parameter dicts with optimizer.state; copy them before
        # the swapped-in tensors are dropped from the optimizer again.
        state_dict["state"] = {index: dict(entry) for index, entry in state_dict["state"].items()}
        self._swap_out(write=False)
        return state_dict

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        # torch's load_state_dict replaces optimizer.state with a plain dict: store what it holds,
        # then wrap it again (ZeroOptimizer re-reads inner.state after this hook). Masters are not
        # part of that dict: ones still in the files come back into memory first, so registering
        # the loaded state does not write placeholders over them.
        with self._internal():
            for pieces in self._pieces.values():
                if not pieces[0].whole_in_memory():
                    assemble(self.store, pieces, with_state=False)
            for sg in self._subgroups:
                if isinstance(sg, MasterPiece):
                    continue
                if sg.masters_out and self._from_store(sg):
                    views = self.store.get(sg.id)
                    sg.install_state({name: tensor.clone() for name, tensor in views.items()
                                      if name.endswith("." + MASTER_KEY)})
                    self.store.put(sg.id, dirty=False)
            self._held.clear()
            self._swap_out(write=True)
        optimizer.state = SwappingState(self, optimizer.state)

    @contextlib.contextmanager
    def _internal(self) -> Iterator[None]:
        """The placement's own state accesses: no lazy swap-in (see :class:`SwappingState`)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _materialize(self, master: Tensor) -> None:
        """Bring the sub-group of ``master`` into the optimizer's memory for outside readers."""
        if self._depth:
            return
        pieces = self._pieces.get(id(master))
        if pieces is not None:
            if not pieces[0].whole_in_memory():
                with self._internal():
                    assemble(self.store, pieces)
                self._held.update(p.id for p in pieces)  # the next step stores it again
            return
        sg = self._subgroup_of.get(id(master))
        if sg is None or not self._from_store(sg):
            return
        with self._internal():
            views = self.store.get(sg.id)
            sg.install_state({name: tensor.clone() for name, tensor in views.items()})
            self.store.put(sg.id, dirty=False)
            # Held: the next step steps it from memory and registers it again, so in-place edits
            # made meanwhile (a sharded checkpoint load) are kept.
            self._held.add(sg.id)

    def _swap_in(self) -> None:
        """Give every stored sub-group's state memory of its own inside the optimizer."""
        with self._internal():
            for pieces in self._pieces.values():
                if not pieces[0].whole_in_memory():
                    if any(p.own is not None for p in pieces):
                        self._held.update(p.id for p in pieces)  # its only copy is the memory one
                    assemble(self.store, pieces)
            for sg in self._subgroups:
                if isinstance(sg, MasterPiece):
                    continue
                if self._from_store(sg):
                    views = self.store.get(sg.id)
                    sg.install_state({name: tensor.clone() for name, tensor in views.items()})
                    self.store.put(sg.id, dirty=False)

    def _swap_out(self, *, write: bool) -> None:
        """Drop the swapped-in state again; with ``write`` store what the optimizer holds first."""
        if self.store is None:
            return
        with self._internal():
            for pieces in self._pieces.values():
                if not pieces[0].whole_in_memory() or pieces[0].id in self._held:
                    continue
                if write:
                    store_whole(self.store, pieces, self._held, None)
                else:
                    drop_whole(pieces)
            for sg in self._subgroups:
                if sg.kept or sg.id in self._held or isinstance(sg, MasterPiece):
                    continue
                current = sg.tensor_state()
                if write and current:
                    self.store.register(sg.id, current)
                if current and sg.id in self.store:
                    sg.drop_tensor_state()
            if write:
                self.store.flush()


class MaterializingMasters(Mapping):
    """:meth:`~plait.offload_io.zero_placement.ZeroOffloadPlacement.masters` for outside readers:
    a lookup first brings an NVMe-resident master (and its sub-group's state) into memory, see
    ``_materialize``."""

    def __init__(self, placement: StateSwapping) -> None:
        self._placement = placement

    def __getitem__(self, key: str) -> Tensor:
        master = self._placement._masters[key]
        self._placement._materialize(master)
        return master

    def __iter__(self) -> Iterator[str]:
        return iter(self._placement._masters)

    def __len__(self) -> int:
        return len(self._placement._masters)


class SwappingState(collections.defaultdict):
    """``optimizer.state`` for ``device="nvme"``: reading an offloaded master's entry from outside
    the placement (``state[master]``, ``state.get(master)``, e.g. plait.zero_sharding's sharded
    checkpoint) first brings its sub-group's tensors into memory, so readers never see the empty
    entries the store leaves between steps."""

    def __init__(self, placement: StateSwapping, state: Mapping) -> None:
        super().__init__(dict, state)
        self._placement = placement

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, Tensor):
            self._placement._materialize(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if isinstance(key, Tensor):
            self._placement._materialize(key)
        return super().get(key, default)

    def __reduce__(self) -> Any:  # deep copies and pickles are plain state dicts
        return (collections.defaultdict, (dict, dict(self)))


__all__ = ["MaterializingMasters", "StateSwapping", "SwappingState"]
