"""``DistributedAttention``: any SDPA-shaped attention callable, run over the sequence-parallel group.

Each rank enters with its slice of the sequence (``[B, H, S/P, D]`` for q, ``[B, H_kv, S/P, D]``
for k and v, positions already applied), the all-to-all hands every rank the whole sequence for
its share of the heads, the wrapped callable runs unchanged on that, and the output goes back to
sequence slices. Masks are therefore global: causal is causal over the true positions, and a
padding mask is given for the whole sequence (every rank of the group has the same batch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.ulysses_sp.all_to_all import HeadLayout, heads_to_seq, seq_to_heads
from plait.ulysses_sp.config import SPGroup, sp_group
from plait.ulysses_sp.masks import global_mask, is_packed


@functools.lru_cache(maxsize=64)
def head_layout(sp: int, q_heads: int, kv_heads: int) -> HeadLayout:
    """Cached :meth:`HeadLayout.build` (one per head shape and group size)."""
    return HeadLayout.build(sp=sp, q_heads=q_heads, kv_heads=kv_heads)


class DistributedAttention(nn.Module):
    """Ulysses attention around any callable with ``F.scaled_dot_product_attention``'s signature.

    Example::

        mesh = make_mesh(dp=-1, sp=2)
        attn = DistributedAttention(mesh=mesh)            # SDPA inside
        out = attn(q, k, v, is_causal=True)               # q: [B, H, S/2, D] on each sp rank

    Args:
        attn_fn: ``fn(q, k, v, attn_mask=None, is_causal=False, **kwargs) -> [B, h, S, D]``; it
            receives as many kv heads as query heads (GQA groups expanded locally).
        mesh: a ``DeviceMesh`` with an ``sp_dim`` dimension, a 1-D mesh, a process group or
            ``None`` (world).
        sp_dim: the mesh dimension name.
    """

    def __init__(self, attn_fn: Callable[..., torch.Tensor] = F.scaled_dot_product_attention, *,
                 mesh: Any = None, sp_dim: str = "sp") -> None:
        super().__init__()
        if not callable(attn_fn):
            raise ValueError(f"DistributedAttention(attn_fn={attn_fn!r}) needs a callable such as "
                             "torch.nn.functional.scaled_dot_product_attention.")
        self.attn_fn = attn_fn
        self.sp: SPGroup = sp_group(mesh, sp_dim=sp_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
                key_padding_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Attention over the whole sequence; returns this rank's slice ``[B, H, S/P, D]``.

        Args:
            query: ``[B, H, S/P, D]``, this rank's sequence slice.
            key: ``[B, H_kv, S/P, D]`` (``H_kv`` divides ``H``; may be smaller than ``sp``).
            value: like ``key``.
            is_causal: causal over global positions (slices are in rank order).
            key_padding_mask: ``[B, S]`` for the whole sequence, True for real tokens.
            position_ids: ``[B, S]`` global positions of the whole sequence, for packed rows: where
                they restart, a new document begins and queries see only their own document.
            **kwargs: passed to ``attn_fn`` (``scale``, ``dropout_p``, ...).

        Raises:
            ValueError: shapes that disagree (named in the message).
        """
        self._check(query, key, value)
        q_heads, seq = gather_heads(query, key, value, self.sp)
        mask = global_mask(key_padding_mask, seq=seq, causal=is_causal, device=query.device,
                           position_ids=position_ids)
        simple_causal = key_padding_mask is None and not is_packed(position_ids)
        if mask is None:
            out = self.attn_fn(*q_heads, is_causal=False, **kwargs)
        elif simple_causal and _is_sdpa(self.attn_fn):
            out = self.attn_fn(*q_heads, is_causal=True, **kwargs)  # SDPA's kernels skip the S x S mask
        else:
            out = self.attn_fn(*q_heads, attn_mask=mask, **kwargs)
        layout = head_layout(self.sp.size, query.shape[1], key.shape[1])
        return heads_to_seq(out, layout.q_splits, self.sp.rank, self.sp.group,
                            name="Ulysses all-to-all of the attention output, heads to sequence")

    @staticmethod
    def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
            raise ValueError(f"DistributedAttention wants q [B, H, S/P, D] and k, v [B, H_kv, S/P, D]; got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
        if query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
            raise ValueError(f"q {tuple(query.shape)} and k {tuple(key.shape)} disagree on batch or sequence.")


def _is_sdpa(fn: Callable) -> bool:
    return fn is F.scaled_dot_product_attention


def gather_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 sp: SPGroup, where: str = "") -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """All-to-all q, k, v to this rank's heads over the whole sequence; kv expanded per query head.

    Args:
        query: ``[B, H, S/P, D]``.
        key: ``[B, H_kv, S/P, D]``.
        value: like ``key``.
        sp: the group.
        where: appended to each exchange's flight-log name (``", layer 7"``).

    Returns:
        ``((q, k, v), S)`` with q, k, v ``[B, h_rank, S, D]`` and the global length ``S``.
    """
    layout = head_layout(sp.size, query.shape[1], key.shape[1])
    name = "Ulysses all-to-all of {}, sequence to heads" + where
    q = seq_to_heads(query, layout.q_ranges(), sp.rank, sp.group, name.format("q"))
    k = seq_to_heads(key, list(layout.kv_index), sp.rank, sp.group, name.format("k"))
    v = seq_to_heads(value, list(layout.kv_index), sp.rank, sp.group, name.format("v"))
    local = layout.kv_local[sp.rank]
    if list(local) != list(range(k.shape[1])):
        index = torch.tensor(local, device=k.device)
        k, v = k.index_select(1, index), v.index_select(1, index)
    return (q, k, v), q.shape[2]
