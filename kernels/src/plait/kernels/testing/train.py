"""The training loop parity tests share: steps over the shared corpus, one rank's slice each."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from plait.kernels.testing.data import global_batch, rank_slice


def train_losses(model: Any, optimizer: Any, steps: int, *, batch: int, seq: int, start: int = 0) -> list[float]:
    """Train ``steps`` steps (forward, backward, ``step``, ``zero_grad``) and return the losses.

    Step ``k`` uses ``global_batch(k, batch, seq)``, sliced to this rank when torch.distributed is
    initialised, so runs that differ only in how they shard see the same data.

    Args:
        model: returns an output with ``.loss`` from ``input_ids``/``labels`` keywords.
        optimizer: anything with ``step()`` and ``zero_grad()``.
        steps: how many steps.
        batch: global batch size (divisible by the world size).
        seq: sequence length.
        start: index of the first step (to continue a run).

    Returns:
        This rank's loss of each step, as Python floats.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for step in range(start, start + steps):
        loss = model(**rank_slice(global_batch(step, batch, seq), rank, world)).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


__all__ = ["train_losses"]
