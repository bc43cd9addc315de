"""Which rows of a checkpoint tensor one vLLM tensor-parallel rank keeps (no vLLM import here).

vLLM's weight loaders take whole tensors and slice out their rank's part themselves. For the
weights they split along dim 0 (column-parallel linears and the vocabulary-parallel embedding
and LM head) the rank keeps one contiguous block of rows, so the loader needs only those rows'
bytes read and checked. For the weights split along dim 1 (the row-parallel ``o_proj`` and
``down_proj``) the rank keeps one block of columns, a byte range in every row: only the checksum
chunks those ranges touch need reading (fewer than all when a chunk is shorter than a row's part).
Every other tensor (norms, routers, fused experts) is read whole. The rules follow vLLM 0.32:

* ``q_proj``, ``gate_proj``, ``up_proj`` (``MergedColumnParallelLinear``, ``QKVParallelLinear``'s
  q): rows ``[r * n / tp, (r + 1) * n / tp)``.
* ``k_proj``, ``v_proj``: the same over the KV heads when ``num_key_value_heads >= tp``; else each
  KV head is replicated on ``tp / num_key_value_heads`` ranks and rank ``r`` keeps head
  ``r // (tp / num_key_value_heads)``.
* ``embed_tokens``, ``lm_head`` (``VocabParallelEmbedding``): the vocabulary padded to a multiple
  of 64 is split evenly, and each rank's block is clipped to the real vocabulary.
* ``o_proj``, ``down_proj`` (``RowParallelLinear``, split on its input dim): columns
  ``[r * n / tp, (r + 1) * n / tp)``.

A rule that does not fit the tensor (sizes that do not divide) gives None: read whole.
"""

from __future__ import annotations

import dataclasses

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``."""

_EVEN = (".q_proj.weight", ".q_proj.bias", ".gate_proj.weight", ".up_proj.weight")
_KV = (".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallelRank:
    """One tensor-parallel rank of a vLLM engine.

    Attributes:
        rank: this rank, in ``[0, size)``.
        size: the tensor-parallel size.
        num_key_value_heads: the model's KV heads (``config.num_key_value_heads``), or None if unknown
            (then ``k_proj``/``v_proj`` are read whole).
    """

    rank: int
    size: int
    num_key_value_heads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"TensorParallelRank.size={self.size!r} must be a positive int.")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallelRank.rank={self.rank!r} must be in [0, {self.size}).")


def _even(rows: int, rank: int, size: int) -> tuple[int, int] | None:
    if rows % size:
        return None
    per = rows // size
    return rank * per, (rank + 1) * per


def rank_rows(name: str, shape: tuple[int, ...], tp: TensorParallelRank) -> tuple[int, int] | None:
    """Rows ``[start, stop)`` of dim 0 that rank ``tp.rank`` keeps of tensor ``name``, or None (whole).

    Args:
        name: the HF ``state_dict`` name.
        shape: the tensor's shape.
        tp: the rank.

    Returns:
        The row range, or None when the rank needs the whole tensor (TP=1, a tensor not split
        along dim 0, or sizes the rule does not divide).
    """
    if tp.size == 1 or not shape:
        return None
    rows = shape[0]
    if name.endswith(_EVEN):
        return _even(rows, tp.rank, tp.size)
    if name.endswith(_KV):
        heads = tp.num_key_value_heads
        if not heads or rows % heads:
            return None
        if heads >= tp.size:
            return _even(rows, tp.rank, tp.size) if heads % tp.size == 0 else None
        if tp.size % heads:
            return None
        head = tp.rank // (tp.size // heads)
        per = rows // heads
        return head * per, (head + 1) * per
    if name.endswith(_VOCAB):
        padded = -(-rows // VOCAB_PADDING) * VOCAB_PADDING
        if padded % tp.size:
            return None
        per = padded // tp.size
        return min(tp.rank * per, rows), min((tp.rank + 1) * per, rows)
    return None


def rank_cols(name: str, shape: tuple[int, ...], tp: TensorParallelRank) -> tuple[int, int] | None:
    """Columns ``[start, stop)`` of dim 1 that rank ``tp.rank`` keeps of a row-parallel weight, or None.

    Args:
        name: the HF ``state_dict`` name.
        shape: the tensor's shape.
        tp: the rank.

    Returns:
        The column range of ``o_proj``/``down_proj`` weights (2-D, columns divisible by ``tp.size``),
        else None (TP=1, or a tensor this rule does not cover).
    """
    if tp.size == 1 or len(shape) != 2 or not name.endswith(_ROW_PARALLEL):
        return None
    return _even(shape[1], tp.rank, tp.size)
