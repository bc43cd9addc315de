"""Squared gradient norms accumulated in float64, for global-norm clipping.

torch's CPU ``vector_norm`` of an fp32 tensor accumulates in fp32 and loses about 1e-4 of a
million-element shard's norm; that shifts the clip coefficient (and every later step) away from one
process's exact norm and from DeepSpeed's, whose per-tensor norms are taken in float64.
"""

from __future__ import annotations

import torch

#: elements per float64 piece of a gradient-norm sum (an 8 MiB temporary; see shard_sumsq)
NORM_CHUNK = 1 << 20


def shard_sumsq(grad: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of one gradient shard as a float64 scalar, accumulated in float64.

    torch's CPU ``vector_norm`` of an fp32 tensor accumulates in fp32 and loses about 1e-4 of a
    million-element shard's norm, which shifts the clip coefficient (and so every later step) away
    from DeepSpeed's, whose per-tensor norms are taken in float64. ``dtype=float64`` casts a copy,
    so the shard goes through in pieces of :data:`NORM_CHUNK` elements to bound that copy.
    """
    pieces = grad.reshape(-1).split(NORM_CHUNK)
    return torch.stack([torch.linalg.vector_norm(piece, dtype=torch.float64) for piece in pieces]).square().sum()


__all__ = ["NORM_CHUNK", "shard_sumsq"]
