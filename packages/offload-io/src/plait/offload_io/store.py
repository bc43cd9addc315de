"""State stores: where the tensors of numbered groups live between uses.

A *group* is the unit the optimizer steps at once (a ZeRO sub-group, or a slice of the
parameters of a single process). Its tensors (Adam moments, step counters, optionally fp32
master weights) are handed to a store with :meth:`StateStore.register` and afterwards borrowed
with :meth:`~StateStore.get` and returned with :meth:`~StateStore.put`. The caller announces the
next group with :meth:`~StateStore.prefetch` so the store can read it while the current one
steps. This is the interface plait-zero-sharding's state-placement extension point calls:

.. code-block:: python

    store.prefetch(ids[0])
    for i, gid in enumerate(ids):
        if i + 1 < len(ids):
            store.prefetch(ids[i + 1])        # read next while this one steps
        tensors = store.get(gid)              # resident, modifiable in place
        step(tensors)
        store.put(gid)                        # write back in the background
    store.flush()                             # durable; raises the first I/O error

:class:`CpuStateStore` keeps everything in memory (ZeRO-Offload). :class:`FileStateStore`
(``file_store.py``) keeps one file per group and only a few slots in memory (ZeRO-Infinity).
The caller must use a store from one thread.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable, Iterator, Mapping

import torch

from plait.offload_io.config import DEFAULT_ALIGNMENT


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where one tensor of a group sits in the group's byte image.

    Attributes:
        name: the tensor's key in the group.
        shape: its shape.
        dtype: its dtype.
        offset: byte offset in the group image (aligned, so each tensor can be O_DIRECT'ed).
        nbytes: its size in bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """The byte image of one group: its tensors back to back at aligned offsets.

    Attributes:
        specs: one :class:`TensorSpec` per tensor, in registration order.
        nbytes: bytes of the image (a multiple of the alignment).
    """

    specs: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], alignment: int = DEFAULT_ALIGNMENT) -> GroupLayout:
        """Lay out ``tensors`` at ``alignment``-aligned offsets.

        Args:
            tensors: name -> tensor.
            alignment: offset alignment.

        Returns:
            The layout.
        """
        specs = []
        offset = 0
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype, offset, nbytes))
            offset += -(-max(nbytes, 1) // alignment) * alignment
        return cls(tuple(specs), offset)

    def views(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors viewing ``image`` (a uint8 buffer of at least ``nbytes``) per this layout."""
        return {s.name: image[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.specs}

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` have exactly this layout's names, shapes and dtypes."""
        if len(tensors) != len(self.specs):
            return False
        return all(
            s.name in tensors and tuple(tensors[s.name].shape) == s.shape and tensors[s.name].dtype == s.dtype
            for s in self.specs
        )


class StateStore(abc.ABC):
    """Where groups of tensors live between uses. See the module docstring for the protocol."""

    @abc.abstractmethod
    def register(self, group_id: Hashable, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hand a group's tensors to the store, replacing any earlier layout of that group.

        The values are taken now; afterwards use :meth:`get` for the store's own copy. A group
        that is currently borrowed (``get`` without ``put``) may not be re-registered.

        Args:
            group_id: any hashable id.
            tensors: name -> CPU tensor.

        Raises:
            OffloadDiskFullError: a file store lacks the space for the group.
            ValueError: the group is borrowed, or a tensor is not a CPU tensor.
        """

    @abc.abstractmethod
    def get(self, group_id: Hashable) -> dict[str, torch.Tensor]:
        """Borrow a group's tensors, resident in CPU memory and modifiable in place.

        They stay valid until :meth:`put`. Waits for a prefetch in flight.

        Raises:
            KeyError: the group was never registered.
            OffloadIOError: reading it back failed.
        """

    @abc.abstractmethod
    def put(self, group_id: Hashable, *, dirty: bool = True) -> None:
        """Return a borrowed group. ``dirty=False`` says it was only read (no write-back)."""

    def prefetch(self, group_id: Hashable) -> None:  # noqa: B027 - optional hook, memory stores ignore it
        """Start bringing ``group_id`` into memory so a later :meth:`get` does not wait."""

    def take_errors(self) -> list:
        """Write-back failures recorded so far, without waiting for writes still in flight
        (and forgetting them: each is reported once). Memory stores never fail."""
        return []

    def flush(self) -> None:  # noqa: B027
        """Wait until every write-back is durable; retry failed ones; raise the first failure."""

    def close(self) -> None:  # noqa: B027
        """Release files and threads. Idempotent."""

    @abc.abstractmethod
    def __contains__(self, group_id: Hashable) -> bool: ...

    @abc.abstractmethod
    def group_ids(self) -> Iterator[Hashable]:
        """Registered group ids, in registration order."""

    @abc.abstractmethod
    def layout(self, group_id: Hashable) -> GroupLayout:
        """The layout of a registered group."""

    @property
    @abc.abstractmethod
    def resident_bytes(self) -> int:
        """Bytes of CPU memory the store holds now (its share of the process's resident set)."""

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class CpuStateStore(StateStore):
    """Every group in CPU memory; ``get``/``put`` cost nothing (ZeRO-Offload placement).

    Args:
        pinned: copy registered tensors into page-locked memory (for fast device copies).
    """

    def __init__(self, *, pinned: bool = False) -> None:
        self.pinned = pinned
        self._groups: dict[Hashable, dict[str, torch.Tensor]] = {}
        self._layouts: dict[Hashable, GroupLayout] = {}
        self._borrowed: set[Hashable] = set()

    def register(self, group_id: Hashable, tensors: Mapping[str, torch.Tensor]) -> None:
        if group_id in self._borrowed:
            raise ValueError(f"group {group_id!r} is borrowed (get without put); put it back before register.")
        owned = {}
        for name, tensor in tensors.items():
            _check_cpu(group_id, name, tensor)
            owned[name] = tensor.detach().clone().pin_memory() if self.pinned else tensor.detach().clone()
        self._groups[group_id] = owned
        self._layouts[group_id] = GroupLayout.of(owned)

    def get(self, group_id: Hashable) -> dict[str, torch.Tensor]:
        tensors = self._groups[group_id]
        self._borrowed.add(group_id)
        return dict(tensors)

    def put(self, group_id: Hashable, *, dirty: bool = True) -> None:
        self._borrowed.discard(group_id)

    def __contains__(self, group_id: Hashable) -> bool:
        return group_id in self._groups

    def group_ids(self) -> Iterator[Hashable]:
        return iter(list(self._groups))

    def layout(self, group_id: Hashable) -> GroupLayout:
        return self._layouts[group_id]

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for g in self._groups.values() for t in g.values())


def _check_cpu(group_id: Hashable, name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        where = getattr(tensor, "device", type(tensor).__name__)
        raise ValueError(f"state store: tensor {name!r} of group {group_id!r} is on {where}; "
                         "stores hold CPU tensors, move it with .cpu() first.")
