"""Masters handed over unit by unit: ``zero_shard`` without the whole model in memory.

Without this, ``zero_shard`` builds every unit's fp32 master first and the placement moves them
into its state files only once the optimizer exists, so at world size 1 (where a rank's shard is
the whole unit) the process holds the whole model once on its way to disk: a model bigger than
memory could be built straight to the store and still not be sharded.

With parameters and state on NVMe, plait-zero-sharding hands each unit over as soon as it is
built (the optional placement member ``release_master``): the unit's compute shard goes to the
parameter files, the placed master becomes a zero-stride placeholder of its shape, and this
registry remembers where its values are. When the optimizer exists, the placement moves the
masters into the state store one sub-group at a time (:meth:`ReleasedMasters.load` before a
sub-group registers, the placeholder back right after), so ``zero_shard``'s peak is one unit
plus the store's slots, not the model.

Where the values are: in fp32 without separate low-precision shards, a unit's master *is* its
compute shard, already written to the parameter files under the unit's key; nothing more is
written. Otherwise (a bf16 compute shard beside an fp32 master) the master is written to the same
storage under a key of its own and that file is deleted once the state store holds the values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from plait.offload_io.buffers import aligned_empty


def placeholder(like: Tensor) -> Tensor:
    """A one-element zero-stride tensor of ``like``'s shape and dtype (no memory of the shape)."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)


def is_placeholder(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a :func:`placeholder` (every stride zero, more than one element)."""
    return tensor.numel() > 1 and all(s == 0 for s in tensor.stride())


class ReleasedMasters:
    """Masters whose values wait in a shard storage until the state store takes them.

    Args:
        storage: the parameter shard storage (``write``/``read``/``discard`` by key, returning
            handles with ``wait()``).
    """

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self._where: dict[int, tuple[str, bool]] = {}  # id(master) -> (storage key, own file)

    def __contains__(self, master: Tensor) -> bool:
        return id(master) in self._where

    def __len__(self) -> int:
        return len(self._where)

    def release(self, key: str, master: Tensor, *, stored_as: str | None) -> None:
        """Let go of ``master``'s values (they are, or are now written, in the storage).

        Args:
            key: the unit key.
            master: the placed master (its ``.data`` becomes a placeholder).
            stored_as: the storage key that already holds exactly these values (the unit's
                compute shard when it is the fp32 master), or ``None`` to write them now.

        Raises:
            whatever the storage raises for the write (the master then keeps its values).
        """
        own = stored_as is None
        if own:
            stored_as = f"{key}.master"
            handle = self.storage.write(stored_as, master.detach().contiguous())
            if handle is not None:
                handle.wait()
        self._where[id(master)] = (stored_as, own)
        master.data = placeholder(master)

    def load(self, masters: list[Tensor]) -> None:
        """Give every released master of ``masters`` its values back (aligned memory), in place."""
        for master in masters:
            where = self._where.get(id(master))
            if where is None or not is_placeholder(master):
                continue
            values = aligned_empty(master.numel() * master.element_size(), dtype=master.dtype)
            handle = self.storage.read(where[0], values)
            if handle is not None:
                handle.wait()
            master.data = values.view(master.shape)

    def forget(self, masters: list[Tensor]) -> None:
        """The state store holds these masters now: delete the files written for them alone."""
        for master in masters:
            where = self._where.pop(id(master), None)
            if where is not None and where[1]:
                self.storage.discard(where[0])
