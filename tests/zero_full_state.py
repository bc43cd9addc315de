"""Optimizer state of a ZeRO model per parameter name, whole: comparable across unit layouts.

ZeRO-Infinity (offloaded parameters) gives the embedding and the head units of their own, while
in-memory ZeRO-3 keeps them in the root unit, so the inner optimizers' state is indexed
differently; the sharded view (``model.sharded_state_dict()``) names every piece by parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def full_optimizer_state(model) -> dict[str, torch.Tensor]:
    """``optim.<state>.<parameter>`` -> the whole flattened tensor, every rank's pieces put
    together (collective: one object all-gather). Elements no rank holds stay NaN, so a gap
    never compares equal."""
    mine = [(name, piece.spec.global_shape, piece.spec.flat_range, piece.local.detach().reshape(-1).clone())
            for name, piece in model.sharded_state_dict().items() if name.startswith("optim.")]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for theirs in everyone:
        for name, shape, (lo, hi), local in theirs:
            whole = out.setdefault(name, torch.full((torch.Size(shape).numel(),), float("nan"), dtype=local.dtype))
            whole[lo:hi] = local
    return out
