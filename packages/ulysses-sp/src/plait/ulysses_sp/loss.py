"""The loss over a sequence split across ranks: sum the valid tokens' losses, divide once.

A per-rank mean would weight each rank's slice equally however many of its tokens count
(padding and ``-100`` labels are spread unevenly over slices). Instead every rank divides its own
*sum* by the group's total count of valid tokens: the shares then sum, over the sp group, to
exactly the single-process mean, at any split.

Gradients: each rank's parameter gradients come from its own tokens, so they must be *summed*
over the sp group (:func:`sum_sp_gradients`). A data-parallel reducer that *averages* over
``dp x sp`` ranks (plait ZeRO, DDP) divides by ``sp`` too many: pass ``scale=sp`` (the loss
contract of the engine notes: ``loss_j = local_sum_j * sp / T_group``) and let it average.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import collectives
from plait.ulysses_sp.config import sp_group
from plait.ulysses_sp.sharding import IGNORE_INDEX
from plait.ulysses_sp.tiled import tiled_cross_entropy


def sp_token_count(labels: torch.Tensor, mesh: Any = None, *, sp_dim: str = "sp",
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Valid (not ``ignore_index``) labels over the whole sp group: one small all-reduce.

    Returns:
        A float scalar, at least 1 (a batch of only ignored labels gives a zero loss, not NaN).
    """
    sp = sp_group(mesh, sp_dim=sp_dim)
    count = (labels != ignore_index).sum().to(torch.float32).reshape(1)
    collectives.all_reduce(count, group=sp.group, name="Ulysses loss: valid-token count all-reduce")
    return count.clamp_min(1.0)[0]


def sp_cross_entropy(logits: torch.Tensor, shift_labels: torch.Tensor, mesh: Any = None, *, sp_dim: str = "sp",
                     ignore_index: int = IGNORE_INDEX, scale: float = 1.0) -> torch.Tensor:
    """This rank's share of the group's mean next-token loss.

    Args:
        logits: ``[B, S/P, V]`` for this rank's slice.
        shift_labels: ``[B, S/P]`` already-shifted labels (``shard_batch``'s ``shift_labels``).
        mesh: a mesh with ``sp_dim``, a process group or ``None`` (world).
        sp_dim: the mesh dimension name.
        ignore_index: label value that does not count.
        scale: multiply the share (``sp`` under an averaging reducer over dp x sp).

    Returns:
        ``scale * local_sum / group_valid_tokens``; summed over the group it is the mean loss.
    """
    total = sp_token_count(shift_labels, mesh, sp_dim=sp_dim, ignore_index=ignore_index)
    local = F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=ignore_index,
                            reduction="sum")
    return local * (scale / total)


def sp_tiled_cross_entropy(hidden: torch.Tensor, lm_head: nn.Linear, shift_labels: torch.Tensor, mesh: Any = None,
                           *, chunks: int, sp_dim: str = "sp", ignore_index: int = IGNORE_INDEX,
                           scale: float = 1.0) -> torch.Tensor:
    """:func:`sp_cross_entropy` from hidden states, with logits tiled (:func:`tiled_cross_entropy`).

    Args:
        hidden: ``[B, S/P, h]`` final hidden states (after the final norm).
        lm_head: the output projection.
        shift_labels: ``[B, S/P]``.
        mesh: as in :func:`sp_cross_entropy`.
        chunks: sequence chunks for the logits.
        sp_dim: the mesh dimension name.
        ignore_index: label value that does not count.
        scale: as in :func:`sp_cross_entropy`.
    """
    total = sp_token_count(shift_labels, mesh, sp_dim=sp_dim, ignore_index=ignore_index)
    local = tiled_cross_entropy(hidden, lm_head.weight, shift_labels, chunks=chunks, bias=lm_head.bias,
                                ignore_index=ignore_index)
    return local * (scale / total)


def sp_loss_value(share: torch.Tensor, mesh: Any = None, *, sp_dim: str = "sp", scale: float = 1.0) -> float:
    """The group's loss for logging: the sum of the shares (divided by ``scale``); no gradient."""
    sp = sp_group(mesh, sp_dim=sp_dim)
    value = share.detach().float().reshape(1).clone()
    collectives.all_reduce(value, group=sp.group, name="Ulysses loss value all-reduce (for logging)")
    return float(value[0]) / scale


def sum_sp_gradients(module: nn.Module, mesh: Any = None, *, sp_dim: str = "sp") -> None:
    """Sum parameter gradients over the sp group (use without a dp x sp reducer; one all-reduce per tensor).

    Args:
        module: the model after ``backward()``.
        mesh: as in :func:`sp_cross_entropy`.
        sp_dim: the mesh dimension name.
    """
    sp = sp_group(mesh, sp_dim=sp_dim)
    if sp.size == 1:
        return
    for param in module.parameters():
        if param.grad is not None:
            collectives.all_reduce(param.grad, group=sp.group, name="Ulysses sp gradient all-reduce")
