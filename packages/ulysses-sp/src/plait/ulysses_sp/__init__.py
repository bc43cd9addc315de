"""plait-ulysses-sp: Ulysses sequence parallelism and ALST's long-sequence tools.

- :class:`DistributedAttention` wraps any SDPA-shaped attention: all-to-all of q/k/v from
  sequence slices to head shards over the mesh's ``sp`` dimension and back (GQA/MQA, uneven
  heads, causal and padding masks).
- :func:`apply_ulysses` / :func:`remove_ulysses` do the same for HF transformers models through
  ``AttentionInterface`` (``pip install 'plait-ulysses-sp[hf]'``).
- :func:`shard_batch`, :class:`SequenceParallelLoader`: each rank's slice of ids, true position
  ids and shifted labels; :func:`sp_cross_entropy` and friends: the loss summed over valid tokens
  of the sp group and divided once.
- ALST: :class:`TiledMLP` / :func:`tile_mlp`, :func:`tiled_cross_entropy` and
  :func:`tile_lm_head` (never the full logits), :func:`offloaded_checkpoint` (checkpointed inputs on the host).
- :mod:`plait.ulysses_sp.zero_extension`: ``SequenceParallelExtension``, the ZeRO-composition
  extension the Lightning and HF Trainer integrations plug in for ``sp_size``.
"""

from plait.ulysses_sp.all_to_all import HeadLayout, all_to_all_rows, heads_to_seq, seq_to_heads
from plait.ulysses_sp.attention import DistributedAttention
from plait.ulysses_sp.config import SPGroup, UlyssesConfig, sp_group
from plait.ulysses_sp.loss import (
    sp_cross_entropy,
    sp_loss_value,
    sp_tiled_cross_entropy,
    sp_token_count,
    sum_sp_gradients,
)
from plait.ulysses_sp.offload import enable_offloaded_checkpointing, offloaded_checkpoint
from plait.ulysses_sp.sharding import (
    SequenceParallelLoader,
    dp_coordinates,
    gather_sequence,
    shard_batch,
    shard_sequence,
    shift_labels,
)
from plait.ulysses_sp.tiled import (
    TiledMLP,
    tile_lm_head,
    tile_mlp,
    tiled_apply,
    tiled_cross_entropy,
    untile_mlp,
)

__all__ = [
    "DistributedAttention", "HeadLayout", "SPGroup", "SequenceParallelLoader", "TiledMLP", "UlyssesConfig",
    "all_to_all_rows", "dp_coordinates", "enable_offloaded_checkpointing", "gather_sequence", "heads_to_seq",
    "offloaded_checkpoint", "seq_to_heads", "shard_batch", "shard_sequence", "shift_labels",
    "sp_cross_entropy", "sp_group", "sp_loss_value", "sp_tiled_cross_entropy", "sp_token_count",
    "sum_sp_gradients", "tile_lm_head", "tile_mlp", "tiled_apply", "tiled_cross_entropy", "untile_mlp",
]


def __getattr__(name: str) -> object:
    # The HF adapter imports transformers lazily; expose its names without importing it here.
    if name in ("apply_ulysses", "remove_ulysses", "is_ulysses", "UnsupportedModelError"):
        from plait.ulysses_sp import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'plait.ulysses_sp' has no attribute {name!r}")
