"""Sequence sharding of a batch for the sp group, and the loader adapter that applies it.

Every rank of an sp group must see the same batch (a ``DistributedSampler`` over the ``dp``
dimension only, see :func:`dp_coordinates`) and keep its contiguous slice of the sequence. The
sequence is padded to a multiple of ``sp`` here (padded labels are ignored, position ids keep
counting) and labels are shifted for next-token prediction *before* slicing, because the token
that labels a slice's last position lives on the next rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.kernels import collectives
from plait.ulysses_sp.config import SPGroup, sp_group
from plait.ulysses_sp.masks import document_starts

IGNORE_INDEX = -100


def padded_length(seq: int, sp: int) -> int:
    """``seq`` rounded up to a multiple of ``sp``.

    Raises:
        ValueError: ``seq < sp`` (some rank would hold no token).
    """
    if seq < sp:
        raise ValueError(f"sequence length {seq} is shorter than sp={sp}: every sp rank needs at least one "
                         f"token; use sequences of >= {sp} tokens or a smaller sp.")
    return -(-seq // sp) * sp


def shard_sequence(tensor: torch.Tensor, sp: SPGroup, *, pad_value: float | int = 0, dim: int = 1) -> torch.Tensor:
    """Pad ``tensor`` along ``dim`` to a multiple of ``sp.size`` and return this rank's slice.

    Args:
        tensor: the whole sequence (same on every rank of the group).
        sp: the group.
        pad_value: the value of padded positions.
        dim: the sequence dimension.

    Returns:
        ``tensor``'s ``sp.rank``-th contiguous slice of length ``padded / sp``.
    """
    seq = tensor.shape[dim]
    total = padded_length(seq, sp.size)
    if total != seq:
        pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, total - seq]
        tensor = F.pad(tensor, pad, value=pad_value)
    return tensor.narrow(dim, sp.rank * (total // sp.size), total // sp.size)


def shift_labels(labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets: position ``t`` is labelled with ``labels[t + 1]``; the last with ``ignore_index``."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def shard_batch(batch: dict[str, torch.Tensor], mesh: Any = None, *, sp_dim: str = "sp", pad_token_id: int = 0,
                causal: bool = True) -> dict[str, torch.Tensor]:
    """This rank's part of a causal-LM batch: sliced ids, true position ids, shifted labels.

    Args:
        batch: ``input_ids`` ``[B, S]``; optional ``labels`` (``-100`` = ignore),
            ``attention_mask`` (1 = real token) and ``position_ids``.
        mesh: a mesh with ``sp_dim``, a process group or ``None`` (world).
        sp_dim: the mesh dimension name.
        pad_token_id: the id of padding added to reach a multiple of sp.
        causal: trailing padding needs no mask under causal attention (real tokens never see
            later ones), so no ``key_padding_mask`` is produced for it alone.

    Returns:
        ``input_ids``, ``position_ids``, and when labels were given ``shift_labels`` (already
        shifted: pass them to HF models as ``shift_labels=``), all ``[B, S_padded / sp]``; and
        ``key_padding_mask`` ``[B, S_padded]`` for the whole sequence and ``attention_mask`` (its
        ``[B, S_padded / sp]`` slice) when there is padding that attention must not see. Where
        ``position_ids`` restart inside a row (packed documents), the last token of a document
        gets no target: the next token belongs to another document.

    Raises:
        ValueError: missing ``input_ids``, or a sequence shorter than sp.
    """
    if "input_ids" not in batch:
        raise ValueError(f"shard_batch needs 'input_ids' in the batch; it has {sorted(batch)}.")
    sp = sp_group(mesh, sp_dim=sp_dim)
    ids = batch["input_ids"]
    bsz, seq = ids.shape
    total = padded_length(seq, sp.size)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(total, device=ids.device).expand(bsz, total)
    else:
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, total - seq + 1, device=ids.device)], 1)
    out = {"input_ids": shard_sequence(ids, sp, pad_value=pad_token_id),
           "position_ids": shard_sequence(positions, sp)}
    if batch.get("labels") is not None:
        out["shift_labels"] = shard_sequence(_shifted_targets(batch, positions[:, :seq]), sp, pad_value=IGNORE_INDEX)
    mask = batch.get("attention_mask")
    if mask is not None or (total != seq and not causal):
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        out["key_padding_mask"] = F.pad(mask, (0, total - seq), value=False)
        out["attention_mask"] = shard_sequence(out["key_padding_mask"], sp)
    return out


def _shifted_targets(batch: dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """Shifted labels, ignored at and after padding and where the next token starts another packed document."""
    labels, mask = batch["labels"], batch.get("attention_mask")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    shifted = shift_labels(labels)
    if mask is not None:  # a padding position predicts nothing (the last left pad would "predict" the first token)
        shifted = shifted.masked_fill(mask == 0, IGNORE_INDEX)
    # a document's last token must not be trained to predict the first token of the next one
    next_starts = F.pad(document_starts(positions)[:, 1:], (0, 1), value=False)
    return shifted.masked_fill(next_starts, IGNORE_INDEX)


def gather_sequence(local: torch.Tensor, mesh: Any = None, *, sp_dim: str = "sp", seq_len: int | None = None,
                    dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's slice, padding removed (no gradient: for outputs).

    Args:
        local: this rank's slice.
        mesh: as in :func:`shard_batch`.
        sp_dim: the mesh dimension name.
        seq_len: the original length, to drop the padding ``shard_batch`` added.
        dim: the sequence dimension.

    Returns:
        The concatenated slices, cut to ``seq_len``.
    """
    sp = sp_group(mesh, sp_dim=sp_dim)
    moved = local.detach().movedim(dim, 0).contiguous()
    full = moved.new_empty((sp.size * moved.shape[0], *moved.shape[1:]))
    collectives.all_gather_into_tensor(full, moved, group=sp.group, name="Ulysses gather_sequence all-gather")
    full = full.movedim(0, dim)
    return full if seq_len is None else full.narrow(dim, 0, seq_len)


def dp_coordinates(mesh: Any = None, *, sp_dim: str = "sp") -> tuple[int, int]:
    """``(dp_rank, dp_size)``: what a ``DistributedSampler`` needs so an sp group shares its batches.

    Ranks with the same ``dp_rank`` are one sp group and must load the same samples.
    """
    sp = sp_group(mesh, sp_dim=sp_dim)
    return dist.get_rank() // sp.size, dist.get_world_size() // sp.size


class SequenceParallelLoader:
    """Wraps a data loader whose batches every rank of the sp group shares; yields :func:`shard_batch`.

    Example::

        rank, size = dp_coordinates(mesh)
        sampler = DistributedSampler(dataset, num_replicas=size, rank=rank)
        loader = SequenceParallelLoader(DataLoader(dataset, sampler=sampler, batch_size=4), mesh)

    Args:
        loader: any iterable of dict batches with ``input_ids`` (and ``labels``...).
        mesh: as in :func:`shard_batch`.
        sp_dim: the mesh dimension name.
        pad_token_id: as in :func:`shard_batch`.
        causal: as in :func:`shard_batch`.
    """

    def __init__(self, loader: Iterable[dict[str, torch.Tensor]], mesh: Any = None, *, sp_dim: str = "sp",
                 pad_token_id: int = 0, causal: bool = True) -> None:
        sp_group(mesh, sp_dim=sp_dim)  # fail here, not at the first batch
        self.loader, self.mesh, self.sp_dim = loader, mesh, sp_dim
        self.pad_token_id, self.causal = pad_token_id, causal

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            yield shard_batch(batch, self.mesh, sp_dim=self.sp_dim, pad_token_id=self.pad_token_id,
                              causal=self.causal)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]
