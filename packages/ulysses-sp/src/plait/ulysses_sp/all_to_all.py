"""The sequence <-> head all-to-all at the heart of Ulysses, with its own backward.

Layout convention (the one SDPA and HF attention functions use): ``[batch, heads, seq, head_dim]``.
Before attention every rank of the ``sp`` group holds its contiguous slice of the sequence for all
heads; :func:`seq_to_heads` turns that into the whole sequence for this rank's share of the heads,
and :func:`heads_to_seq` turns the attention output back.

Why it is built this way:

* One primitive, ``plait.kernels.collectives.all_to_all_rows`` (the custom op
  ``plait::all_to_all_rows``), exchanges rows (dim 0) with uneven split sizes through
  ``plait.kernels.collectives.all_to_all_single``; its backward is the same exchange with the
  split sizes swapped, so the ledger sees forward and backward traffic alike. Being a custom op,
  it stays one node of a compiled block's graph (no graph break under ``torch.compile``) while
  its flight-log and ledger bookkeeping runs eagerly. Everything else
  (head selection, permutes, reshapes) is ordinary differentiable torch.
* Every exchange is named in plait's flight log (``Ulysses all-to-all of q, sequence to heads,
  layer 7``; its backward adds ``(backward)``), so a rank that never enters one is named, with
  the exchange, in the other ranks' :class:`~plait.kernels.collectives.CollectiveError`. The
  name travels with the autograd node because backward may run on another thread, outside the
  caller's :func:`~plait.kernels.collectives.named` blocks.
* Heads that do not divide by ``sp`` are split unevenly (the first ``H % sp`` ranks take one
  more), as ``torch.tensor_split`` does; nothing is padded.
* Key/value heads are sent per rank as exactly the kv heads that rank's query heads read (GQA
  groups of ``H / H_kv``). With fewer kv heads than ranks (MQA, kv=1, 2 < sp) a kv head is sent to
  every rank that needs it: replication as needed. The backward of that selection sums the
  replicas' gradients (autograd's ``index_select`` backward).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from plait.kernels import collectives


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Which query and key/value heads each rank of the sp group owns during attention.

    Attributes:
        sp: ranks in the sequence-parallel group.
        q_heads: query heads (``num_attention_heads``).
        kv_heads: key/value heads (``num_key_value_heads``; equal to ``q_heads`` without GQA).
        q_splits: query heads per rank (contiguous ranges, uneven when ``q_heads % sp``).
        kv_index: per rank, the kv heads its query heads read, in order.
        kv_local: per rank, for each of its query heads, the position of its kv head in
            ``kv_index[rank]`` (used to expand kv to one head per query head locally).
    """

    sp: int
    q_heads: int
    kv_heads: int
    q_splits: tuple[int, ...]
    kv_index: tuple[tuple[int, ...], ...]
    kv_local: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, *, sp: int, q_heads: int, kv_heads: int) -> HeadLayout:
        """Plan the head split.

        Args:
            sp: sequence-parallel group size (>= 1).
            q_heads: query heads (at least ``sp``: every rank owns one or more).
            kv_heads: key/value heads; must divide ``q_heads``.

        Returns:
            The layout.

        Raises:
            ValueError: ``q_heads < sp`` (a rank would own no head), or ``kv_heads`` does not
                divide ``q_heads``.
        """
        if sp < 1:
            raise ValueError(f"sp={sp} must be >= 1.")
        if q_heads < sp:
            raise ValueError(
                f"num_attention_heads={q_heads} is smaller than sp={sp}: Ulysses gives every rank at "
                f"least one query head; use sp <= {q_heads}."
            )
        if kv_heads < 1 or q_heads % kv_heads:
            raise ValueError(
                f"num_key_value_heads={kv_heads} must be >= 1 and divide num_attention_heads={q_heads}."
            )
        base, extra = divmod(q_heads, sp)
        q_splits = tuple(base + (1 if r < extra else 0) for r in range(sp))
        group = q_heads // kv_heads
        kv_index, kv_local, start = [], [], 0
        for size in q_splits:
            wanted = [q // group for q in range(start, start + size)]
            unique = sorted(set(wanted))
            kv_index.append(tuple(unique))
            kv_local.append(tuple(unique.index(k) for k in wanted))
            start += size
        return cls(sp=sp, q_heads=q_heads, kv_heads=kv_heads, q_splits=q_splits,
                   kv_index=tuple(kv_index), kv_local=tuple(kv_local))

    def q_ranges(self) -> list[tuple[int, ...]]:
        """Per rank, its query heads (contiguous, in order)."""
        ends = [sum(self.q_splits[: r + 1]) for r in range(self.sp)]
        return [tuple(range(end - size, end)) for end, size in zip(ends, self.q_splits, strict=True)]

    def bytes_per_layer(self, *, batch: int, seq: int, head_dim: int, itemsize: int, rank: int = 0,
                        backward: bool = False) -> int:
        """Logical bytes ``rank`` sends in one attention forward (q, k, v in; output back), or backward.

        Rank ``r`` sends its slice of every query head (``H``), of the kv heads each rank reads
        (``K = sum(len(kv_index))``), and its ``h_r`` output heads for every slice
        (``P * h_r``), each ``N / P`` tokens x ``head_dim``, with ``N = batch * seq``:
        ``(H + 2 K + P h_r) * N / P * head_dim * itemsize``. For multi-head attention with
        heads divisible by ``P`` this is the paper's ``4 N h / P`` (``h = H * head_dim``). The
        backward runs each exchange in reverse: ``(P h_r + 2 P k_r + H)`` rows, ``k_r`` the kv
        heads rank ``r`` reads; again ``4 N h / P`` in the even multi-head case.
        """
        local_tokens = batch * seq // self.sp
        kv_sent = sum(len(ix) for ix in self.kv_index)
        rows = self.q_heads + 2 * kv_sent + self.sp * self.q_splits[rank]
        if backward:
            rows = self.sp * self.q_splits[rank] + 2 * self.sp * len(self.kv_index[rank]) + self.q_heads
        return rows * local_tokens * head_dim * itemsize


def all_to_all_rows(rows: torch.Tensor, send: tuple[int, ...], recv: tuple[int, ...], group: Any,
                    name: str = "Ulysses all-to-all") -> torch.Tensor:
    """Differentiable all-to-all of dim-0 rows: ``send[j]`` rows go to rank ``j``, ``recv[j]`` come from it.

    Args:
        rows: ``[sum(send), ...]``.
        send: rows sent to each rank, in rank order.
        recv: rows received from each rank, in rank order.
        group: the process group (the sp group).
        name: the exchange's name in plait's flight log (its backward adds ``(backward)``).

    Returns:
        ``[sum(recv), ...]``, the received rows in rank order.
    """
    return collectives.all_to_all_rows(rows, send, recv, group, name)


def seq_to_heads(x: torch.Tensor, heads_per_rank: list[tuple[int, ...]], rank: int, group: Any,
                 name: str = "Ulysses all-to-all, sequence to heads") -> torch.Tensor:
    """``[B, H, S/P, D]`` (sequence slice, all heads) -> ``[B, h_rank, S, D]`` (all sequence, own heads).

    Args:
        x: this rank's sequence slice, every head.
        heads_per_rank: for each rank, the head indices (of ``x``'s dim 1) it receives; may overlap
            (kv replication).
        rank: this rank's index in the group.
        group: the sp process group.
        name: the exchange's name in plait's flight log.

    Returns:
        The whole sequence (sources concatenated in rank order) for ``heads_per_rank[rank]``.
    """
    batch, _, local_seq, dim = x.shape
    sp = len(heads_per_rank)
    flat = [h for heads in heads_per_rank for h in heads]
    picked = x.index_select(1, torch.tensor(flat, device=x.device)) if flat != list(range(x.shape[1])) else x
    rows = picked.transpose(0, 1)  # [sum heads, B, S/P, D]
    mine = len(heads_per_rank[rank])
    out = all_to_all_rows(rows, tuple(len(h) for h in heads_per_rank), (mine,) * sp, group, name)
    out = out.view(sp, mine, batch, local_seq, dim).permute(2, 1, 0, 3, 4)
    return out.reshape(batch, mine, sp * local_seq, dim)


def heads_to_seq(x: torch.Tensor, q_splits: tuple[int, ...], rank: int, group: Any,
                 name: str = "Ulysses all-to-all, heads to sequence") -> torch.Tensor:
    """``[B, h_rank, S, D]`` -> ``[B, H, S/P, D]``: the inverse of :func:`seq_to_heads` for query heads.

    Args:
        x: attention output for this rank's query heads over the whole sequence.
        q_splits: query heads per rank.
        rank: this rank's index in the group.
        group: the sp process group.
        name: the exchange's name in plait's flight log.

    Returns:
        This rank's sequence slice for every head.
    """
    batch, mine, seq, dim = x.shape
    sp = len(q_splits)
    if seq % sp:
        raise ValueError(f"sequence length {seq} is not a multiple of sp={sp}; pad it (shard_sequence does).")
    assert mine == q_splits[rank], (mine, q_splits, rank)
    rows = x.reshape(batch, mine, sp, seq // sp, dim).permute(2, 1, 0, 3, 4).reshape(sp * mine, batch, seq // sp, dim)
    out = all_to_all_rows(rows, (mine,) * sp, q_splits, group, name)
    return out.transpose(0, 1)
