"""Attention masks over the whole sequence: padding and packed documents, built once per forward.

Under Ulysses each rank attends over the *whole* sequence for its share of the heads, so a mask
must describe the whole sequence too. Two things make one necessary:

* **padding** (``attention_mask`` / ``key_padding_mask``, 1 = real token): keys at padded
  positions are hidden. Padding only at the end of rows needs nothing under causal attention
  (no real query ever sees a later key), so it is left to the causal fast path;
* **packed sequences**: several documents in one row, told apart by their position ids
  restarting (a token whose position is not its predecessor's + 1 starts a document, the rule
  transformers uses for its own packed-sequence detection). A query sees keys of its own
  document only.

Both need the global view, which one rank does not have: :func:`gather_rows` all-gathers the
``[B, S/P]`` slices (integers: a few bytes per token against the ``4·h·itemsize/P`` bytes per
token each attention layer moves).
"""

from __future__ import annotations

import torch

from plait.kernels import collectives
from plait.ulysses_sp.config import SPGroup


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: True where a token starts a document (position not previous + 1; column 0 always).

    Args:
        position_ids: ``[B, S]`` (or ``[1, S]``) global position ids.
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def is_packed(position_ids: torch.Tensor | None) -> bool:
    """Whether any row holds more than one document."""
    return position_ids is not None and bool(document_starts(position_ids)[:, 1:].any())


def is_trailing_padding(key_padding_mask: torch.Tensor) -> bool:
    """Whether every row is real tokens followed only by padding (no real token after a pad)."""
    real = key_padding_mask.bool()
    return bool((real[:, 1:] <= real[:, :-1]).all())


def global_mask(key_padding_mask: torch.Tensor | None, *, seq: int, causal: bool, device: torch.device,
                position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The boolean ``[B or 1, 1, S, S]`` mask (True = attend) over the whole sequence.

    A query whose every key is masked (a left-padding query at position 0) attends to itself, so
    no row is all-masked and no NaN reaches the backward; real queries always see themselves, so
    their result is unchanged.

    Args:
        key_padding_mask: ``[B, S]``, True/1 for real tokens; ``None`` for no padding.
        seq: the global sequence length ``S``.
        causal: add the causal triangle.
        device: where to build it.
        position_ids: ``[B, S]`` global position ids; where they restart inside a row, queries see
            only their own document. ``None``: one document per row.

    Returns:
        The mask, or ``None`` when there is neither padding, packing nor a causal constraint.

    Raises:
        ValueError: a mask or position ids that do not cover ``seq`` tokens.
    """
    for name, tensor in (("key_padding_mask", key_padding_mask), ("position_ids", position_ids)):
        if tensor is not None and tensor.shape[-1] != seq:
            raise ValueError(f"{name} covers {tensor.shape[-1]} tokens but the gathered sequence has {seq}; pass "
                             f"the {name} of the whole (padded) sequence, e.g. shard_batch(...)['key_padding_mask'].")
    packed = is_packed(position_ids)
    if key_padding_mask is None and not packed:
        if not causal:
            return None
        return torch.ones(seq, seq, dtype=torch.bool, device=device).tril().view(1, 1, seq, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    if packed:
        docs = document_starts(position_ids.to(device)).cumsum(-1)
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    if causal:
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    return mask | torch.eye(seq, dtype=torch.bool, device=device)


def gather_rows(local: torch.Tensor, sp: SPGroup, name: str) -> torch.Tensor:
    """``[B, S/P]`` slices (in rank order) -> ``[B, S]`` on every rank of the group; no gradient."""
    if sp.size == 1:
        return local
    moved = local.detach().t().contiguous()
    full = moved.new_empty((sp.size * moved.shape[0], moved.shape[1]))
    collectives.all_gather_into_tensor(full, moved, group=sp.group, name=name)
    return full.t()


def sp_attention_mask(sp: SPGroup, *, local_len: int, causal: bool, device: torch.device,
                      attention_mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The whole-sequence boolean mask for one forward, from what an HF model was called with.

    Args:
        sp: the group.
        local_len: this rank's slice length ``S/P``.
        causal: whether the model's attention is causal.
        device: where to build the mask.
        attention_mask: ``[B, S/P]`` (this rank's slice) or ``[B, S]`` (the whole sequence), 1 = real.
        key_padding_mask: ``[B, S]``, the whole sequence (``shard_batch``'s), 1 = real.
        position_ids: ``[B, S/P]``, this rank's slice of the global positions.

    Returns:
        ``[B, 1, S, S]`` bool (True = attend), or ``None`` when the causal triangle alone is right
        (no padding a real query could see, one document per row).

    Raises:
        ValueError: a 4-D mask, or a mask whose length is neither ``S/P`` nor ``S``.
    """
    seq = local_len * sp.size
    padding = key_padding_mask
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] not in (local_len, seq):
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} under sequence parallelism must be 2-D, "
                f"[B, {local_len}] (this rank's slice) or [B, {seq}] (the whole sequence); 4-D masks cannot be "
                "split by Ulysses: pass the 2-D padding mask and position_ids instead.")
        if attention_mask.shape[-1] != seq:
            attention_mask = gather_rows(attention_mask, sp, "Ulysses attention_mask all-gather")
        padding = attention_mask if padding is None else padding.bool() & attention_mask.bool()
    if padding is not None and (bool(padding.bool().all()) or (causal and is_trailing_padding(padding))):
        padding = None  # nothing a real query could see: the causal fast path is exact for real tokens
    positions = None
    if position_ids is not None and sp.size > 1:
        positions = gather_rows(position_ids, sp, "Ulysses position_ids all-gather (packed sequences)")
    elif position_ids is not None:
        positions = position_ids
    if positions is not None and not is_packed(positions):
        positions = None
    if padding is None and positions is None:
        return None
    return global_mask(padding, seq=seq, causal=causal, device=device, position_ids=positions)
