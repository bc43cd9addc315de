"""Replica consistency (reliability test R12): replicated state must be bitwise equal on every rank.

Resident units (every unit in stages 1/2) hold the full parameters on each rank of their group;
with a replicated mesh dimension (HSDP) every rank of the replicate group holds the same master
shard; the loss scaler is replicated on every rank. A flipped bit in one replica silently diverges the
run, so the check hashes each replicated tensor and all-gathers the 32-byte digests (a few
hundred bytes per check, through the counted collectives).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives


class ReplicaMismatchError(RuntimeError):
    """Replicated state differs across ranks; the message names the tensor and the ranks."""


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    data = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)


def _compare(name: str, tensor: torch.Tensor, group: Any, device: torch.device) -> None:
    size = dist.get_world_size(group)
    if size == 1:
        return
    mine = _digest(tensor.cpu()).to(device)
    everyone = torch.empty(size * mine.numel(), dtype=torch.uint8, device=device)
    collectives.all_gather_into_tensor(everyone, mine, group=group)
    digests = [bytes(chunk.tolist()).hex()[:12] for chunk in everyone.cpu().view(size, -1)]
    if len(set(digests)) != 1:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        majority = max(set(digests), key=digests.count)
        if digests.count(majority) * 2 > size:  # a strict majority says which replicas are odd
            who = f"rank(s) {[ranks[i] for i, d in enumerate(digests) if d != majority]} disagree with the others"
        else:
            who = f"ranks {ranks} disagree and no majority says which copy is right"
        raise ReplicaMismatchError(
            f"replicated {name} differs across ranks: {who} (digests by rank {dict(zip(ranks, digests))}); "
            "a bit flipped or a rank diverged. Restart from the last checkpoint."
        )


def check_replicas(engine: Any, scaler: Any) -> None:
    """Compare every replicated tensor across ranks.

    Args:
        engine: the :class:`~plait.zero_sharding.engine.ZeroEngine`.
        scaler: the :class:`~plait.zero_sharding.loss_scaler.LossScaler`.

    Raises:
        ReplicaMismatchError: on every rank, naming the tensor and the odd rank(s).
    """
    if not dist.is_initialized():
        return
    for unit in engine.units:
        if unit.resident:
            names = ", ".join(slot.name for slot in unit.slots[:3]) + ("..." if len(unit.slots) > 3 else "")
            _compare(f"parameters of unit {unit.key} ({names})", unit.full, unit.group, unit.device)
        if unit.replicate_group is not None:  # HSDP: the same shard lives on every rank of this group
            master = engine.placement.masters()[unit.key]
            _compare(f"master shard of unit {unit.key}", master.detach(), unit.replicate_group, unit.device)
    _compare("loss-scaler state", scaler.as_tensor(), None, engine.device)
