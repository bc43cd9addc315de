"""Small Python-object collectives built on plait.kernels.collectives (so the ledger sees them).

A save exchanges only metadata (piece records, hashes, success flags); tensors never travel
between ranks, since every rank writes and reads its own bytes. Without an initialised process
group everything degrades to a world of one, which is how single-process and offline tools run.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives


@dataclasses.dataclass(frozen=True)
class Group:
    """The ranks taking part in a checkpoint operation.

    Attributes:
        handle: the torch process group (None: the default group, or no distribution at all).
        rank: this process's global rank.
        world_size: ranks in the group.
        ranks: global ranks of the group, in group order.
    """

    handle: Any
    rank: int
    world_size: int
    ranks: tuple[int, ...]

    @property
    def distributed(self) -> bool:
        """Whether collectives are needed (more than one rank)."""
        return self.world_size > 1

    @property
    def leader(self) -> int:
        """The global rank that commits (the group's first rank)."""
        return self.ranks[0]

    @classmethod
    def of(cls, group: Any | None) -> Group:
        """Describe ``group`` (None = the default group when initialised, else a world of one)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1, (0,))
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        return cls(group, dist.get_rank(), len(ranks), ranks)

    def with_handle(self, handle: Any) -> Group:
        """The same ranks over another process group (used by async saves)."""
        return dataclasses.replace(self, handle=handle)


def all_gather_objects(obj: Any, group: Group) -> list[Any]:
    """Every rank's ``obj`` (picklable), in group order."""
    if not group.distributed:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.zeros(group.world_size, dtype=torch.int64)
    collectives.all_gather_into_tensor(sizes, torch.tensor([payload.numel()], dtype=torch.int64),
                                       group=group.handle, name="universal checkpoint object all-gather (sizes)")
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:payload.numel()] = payload
    gathered = torch.empty(longest * group.world_size, dtype=torch.uint8)
    collectives.all_gather_into_tensor(gathered, padded, group=group.handle,
                                       name="universal checkpoint object all-gather (payload)")
    out = []
    for index, size in enumerate(sizes.tolist()):
        chunk = gathered[index * longest:index * longest + size]
        out.append(pickle.loads(chunk.numpy().tobytes()))
    return out


def broadcast_object(obj: Any, group: Group) -> Any:
    """``obj`` from the group's leader on every rank."""
    if not group.distributed:
        return obj
    size = torch.zeros(1, dtype=torch.int64)
    data = b""
    if group.rank == group.leader:
        data = pickle.dumps(obj)
        size[0] = len(data)
    collectives.broadcast(size, src=group.leader, group=group.handle, name="universal checkpoint broadcast (size)")
    buffer = torch.zeros(int(size[0]), dtype=torch.uint8)
    if group.rank == group.leader:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    collectives.broadcast(buffer, src=group.leader, group=group.handle,
                          name="universal checkpoint broadcast (payload)")
    return pickle.loads(buffer.numpy().tobytes())


def agree(error: BaseException | None, group: Group) -> list[tuple[int, str]]:
    """Tell every rank which ranks failed a phase: ``[(rank, message), ...]``, empty when none.

    Every rank calls this after a phase whether or not it failed, so a rank whose write failed
    never leaves the others waiting in a collective.
    """
    mine = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = all_gather_objects(mine, group)
    return [(group.ranks[index], message) for index, message in enumerate(outcomes) if message is not None]
