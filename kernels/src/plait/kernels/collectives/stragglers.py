"""Which rank the others wait on: a summary built from every rank's flight log.

In a collective every rank waits for the last one to arrive, so a slow rank (a straggling node, a
slow data loader) shows up as *other* ranks' time blocked in collectives while its own stays small.
:func:`wait_summary` gathers each rank's recent collectives and, for every collective all ranks
recorded, charges the gap between each rank's arrival and the last arrival to the last-arriving
rank. The rank charged the most is the one the others wait on. Arrival times are wall clocks, so
across hosts this relies on their clocks agreeing (NTP keeps them within milliseconds); each
rank's own blocked time, which needs no clock agreement, is reported next to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from plait.kernels.collectives.flight import LOG
from plait.kernels.collectives.ledger import group_name


@dataclasses.dataclass(frozen=True)
class WaitSummary:
    """Time spent waiting in collectives, per rank of a group.

    Attributes:
        ranks: the global ranks summarised, in group order.
        wait_s: seconds each rank was blocked in collectives.
        waited_on_s: seconds the other ranks spent waiting for each rank to arrive.
        collectives: how many collectives every rank recorded (the ones compared).
    """

    ranks: list[int]
    wait_s: list[float]
    waited_on_s: list[float]
    collectives: int

    @property
    def slowest_rank(self) -> int | None:
        """The rank the others waited on most (``None`` when nobody waited for anyone)."""
        if not self.collectives or max(self.waited_on_s) <= 0:
            return None
        return self.ranks[max(range(len(self.ranks)), key=self.waited_on_s.__getitem__)]

    def __str__(self) -> str:
        per_rank = ", ".join(f"rank {r}: {w:.2f} s" for r, w in zip(self.ranks, self.wait_s))
        slowest = self.slowest_rank
        if slowest is None:
            head = f"no rank kept the others waiting over {self.collectives} collectives"
        else:
            waited = self.waited_on_s[self.ranks.index(slowest)]
            head = (f"rank {slowest} is the one the others wait on most: {waited:.2f} s of their waiting "
                    f"over {self.collectives} collectives")
        return f"{head}; time blocked in collectives: {per_rank}"


def _arrivals(group: str) -> dict[tuple[str, int], tuple[float, float]]:
    """This rank's (entry time, blocked seconds) per collective on ``group``, keyed by the flight
    log's group and number: the default group and every other group over the same ranks
    (``world`` and ``world (group 3)``) count, each numbered on its own."""
    return {(e.group, e.seq): (e.start, e.wait_s) for e in LOG.events
            if e.group == group or e.group.startswith(f"{group} (group ")}


def summarize(per_rank: list[dict[Any, tuple[float, float]]], ranks: list[int]) -> WaitSummary:
    """Build the summary from each rank's :func:`_arrivals` (pure; the test oracle).

    Args:
        per_rank: one dict per rank, collective (number, or (group, number)) -> (entry time, blocked seconds).
        ranks: the global ranks, in the same order.
    """
    common = sorted(set.intersection(*(set(arrivals) for arrivals in per_rank))) if per_rank else []
    waited_on = [0.0] * len(ranks)
    for seq in common:
        starts = [arrivals[seq][0] for arrivals in per_rank]
        last = max(range(len(ranks)), key=starts.__getitem__)
        waited_on[last] += sum(starts[last] - start for start in starts)
    wait = [sum(arrivals[seq][1] for seq in common) for arrivals in per_rank]
    return WaitSummary(ranks=list(ranks), wait_s=wait, waited_on_s=waited_on, collectives=len(common))


def wait_summary(*, group: Any | None = None) -> WaitSummary:
    """Gather every rank's flight log of ``group`` and say which rank the others wait on.

    A collective itself: every rank of ``group`` must call it. The exchange is a metadata
    ``all_gather_object`` outside the byte ledger and the flight log, so calling it changes
    neither.

    Args:
        group: the process group (default: the world).

    Returns:
        The same :class:`WaitSummary` on every rank.
    """
    name = group_name(group)
    mine = _arrivals(name)
    if not dist.is_initialized():
        return summarize([mine], [0])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    return summarize(gathered, ranks)
