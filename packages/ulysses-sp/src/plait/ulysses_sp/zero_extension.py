"""Ulysses as a ZeRO sharding extension: what the Lightning and HF Trainer integrations add for ``sp_size``.

plait-zero-sharding composes features through small *extension* objects (its
``composition.ShardingExtension`` protocol: ``order``, ``check``, ``apply``, ``zero_kwargs``),
applied in the design's fixed order (sequence parallel at 10, MoE at 20, ZeRO last). This module
is that extension for Ulysses, so the integrations only translate their host's settings into
:class:`SequenceParallelExtension`'s arguments. The protocol is matched by shape, so nothing
here imports zero-sharding (it stays an optional companion).

What the extension does:

* :meth:`~SequenceParallelExtension.apply`: ``apply_ulysses`` on every top-level Hugging Face model
  inside the host's module, whose ``loss_function`` becomes :meth:`~SequenceParallelExtension.loss_function`
  (labels arrive already shifted); a module without HF models passes when it holds
  :class:`~plait.ulysses_sp.DistributedAttention` (a custom model that wrapped its own attention).
* :meth:`~SequenceParallelExtension.split`: this rank's slice of a causal-LM batch
  (:func:`~plait.ulysses_sp.shard_batch`). Two data layouts: every rank of an sp group loaded the
  same batch (``batches="shared"``, a sampler over the ``dp`` ranks, as Lightning's strategies
  set up), or each rank loaded its own micro-batch (``batches="per_rank"``, a sampler over every
  rank, as the HF Trainer does): the group's micro-batches are then gathered first
  (:func:`gather_group_batch`) and every rank keeps its slice of their concatenation, so the
  same tokens are trained per step as without sp, each by one rank.
* the loss: ulysses-sp's :func:`~plait.ulysses_sp.sp_cross_entropy` (valid tokens summed over the
  group, divided once) times ``sp``, because ZeRO averages gradients over ``dp x sp``. Under
  ``batches="per_rank"`` a host-given ``num_items_in_batch`` (the HF Trainer's count of the valid
  tokens every rank trains on) is HF's own reduction and is used as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import collectives
from plait.ulysses_sp.attention import DistributedAttention
from plait.ulysses_sp.config import UlyssesConfig
from plait.ulysses_sp.loss import sp_cross_entropy
from plait.ulysses_sp.sharding import IGNORE_INDEX, shard_batch

BATCHES = ("shared", "per_rank")
# Keys of a causal-LM micro-batch that per-rank batches gather across the sp group, with their padding value.
BATCH_PAD = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
SEQUENCE_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")  # what model_inputs replaces


def top_hf_models(module: nn.Module) -> list[nn.Module]:
    """The Hugging Face models inside ``module`` not nested in another one (``[]`` without transformers)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # custom models only
        return []
    found: list[nn.Module] = []
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and not any(sub in set(top.modules()) for top in found):
            found.append(sub)
    return found


def gather_group_batch(inputs: Mapping[str, Any], group: Any, sp: int, *, setting: str = "sp_size") -> dict[str, Any]:
    """The sp group's per-rank micro-batches, concatenated along the batch in rank order.

    Sequences are padded to the group's longest (``input_ids`` 0, ``labels`` -100, an
    ``attention_mask`` of 0, made when lengths differ) so that every rank's rows line up.

    Args:
        inputs: this rank's micro-batch: ``input_ids`` ``[B, S_rank]``, optional ``labels``,
            ``attention_mask`` (and ``num_items_in_batch``, ignored).
        group: the sp process group.
        sp: its size.
        setting: how the host names the sp size in messages (``"PlaitConfig.sp_size"``).

    Returns:
        ``input_ids`` (and ``labels``, ``attention_mask`` when present) ``[sp * B, S_max]``.

    Raises:
        ValueError: a key other than those, or batch sizes that differ across the group.
    """
    extra = sorted(k for k in inputs if k not in BATCH_PAD and k != "num_items_in_batch")
    if "input_ids" not in inputs or extra:
        raise ValueError(f"{setting}={sp} splits causal-LM batches along the sequence: each batch must hold "
                         f"input_ids (and labels, attention_mask) only; got {sorted(inputs)}. Drop the other keys in "
                         "the data collator.")
    ids = inputs["input_ids"]
    shapes = torch.empty(sp * 2, dtype=torch.int64)
    collectives.all_gather_into_tensor(shapes, torch.tensor(ids.shape, dtype=torch.int64), group=group,
                                       name="Ulysses batch shapes all-gather")
    shapes = shapes.view(sp, 2)
    if len(set(shapes[:, 0].tolist())) > 1:
        raise ValueError(f"{setting}={sp}: the sp group's micro-batches have {shapes[:, 0].tolist()} rows; they must "
                         "be equal. Keep accelerate's even_batches (the default) or set dataloader_drop_last=True.")
    length = int(shapes[:, 1].max())
    local = {k: v for k, v in inputs.items() if k in BATCH_PAD and v is not None}
    if length != ids.shape[1] or shapes[:, 1].min() != length:
        local.setdefault("attention_mask", torch.ones_like(ids))
    out = {}
    for key in sorted(local):
        value = F.pad(local[key], (0, length - local[key].shape[1]), value=BATCH_PAD[key]).contiguous()
        gathered = value.new_empty((sp * value.shape[0], *value.shape[1:]))
        collectives.all_gather_into_tensor(gathered, value, group=group, name=f"Ulysses batch all-gather of `{key}`")
        out[key] = gathered
    return out


def model_inputs(batch: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """:func:`~plait.ulysses_sp.shard_batch` of a batch every rank of the sp group holds, as HF model keywords.

    Returns:
        ``input_ids``, ``position_ids`` (true positions), ``labels`` (already shifted; when labels
        were given) and ``key_padding_mask`` (the whole sequence; when there is padding attention
        must not see). The batch's other keys are not included.
    """
    local = shard_batch(dict(batch), mesh)
    out = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    if "shift_labels" in local:
        out["labels"] = local["shift_labels"]  # already shifted: the extension's loss does not shift again
    if "key_padding_mask" in local:
        out["key_padding_mask"] = local["key_padding_mask"]
    return out


class SequenceParallelExtension:
    """Ulysses over the mesh's ``sp`` dimension as a ZeRO composition extension (see the module docstring).

    Example (what an integration does once the process group and mesh exist)::

        ext = SequenceParallelExtension(make_mesh(dp=-1, sp=2), setting="sp_size")
        model = ext.apply(model, mesh)          # or through zero-sharding's apply_extensions
        local = ext.split(batch)                # each step: this rank's slice, labels shifted
        loss = model(**local).loss              # the HF model's loss is ext.loss_function

    Args:
        mesh: a ``DeviceMesh`` with an ``sp`` dimension (``make_mesh(dp=-1, sp=N)``).
        config: options for ``apply_ulysses`` (``None``: :class:`~plait.ulysses_sp.UlyssesConfig`'s defaults).
        setting: how the host names the sp size in error messages (``"sp_size"``,
            ``"PlaitConfig.sp_size"``).
        batches: ``"shared"`` (every rank of an sp group loaded the same batch) or ``"per_rank"``
            (each loaded its own micro-batch; :meth:`split` gathers the group's first).

    Raises:
        ValueError: a ``batches`` value not in :data:`BATCHES`, or a ``config`` that is not a
            ``UlyssesConfig``.
    """

    order = 10  # docs/architecture.md's order: sequence parallel -> MoE (20) -> checkpointing/offload -> ZeRO

    def __init__(self, mesh: Any, config: UlyssesConfig | None = None, *, setting: str = "sp_size",
                 batches: str = "shared") -> None:
        if batches not in BATCHES:
            raise ValueError(f"SequenceParallelExtension(batches={batches!r}) must be one of {BATCHES}.")
        if config is not None and not isinstance(config, UlyssesConfig):
            raise ValueError(f"SequenceParallelExtension(config={config!r}) must be a plait.ulysses_sp.UlyssesConfig "
                             "or None.")
        self.mesh, self.config, self.setting, self.batches = mesh, config, setting, batches
        self.sp = mesh["sp"].size()
        self.group = mesh["sp"].get_group()

    def __repr__(self) -> str:
        return f"SequenceParallel(sp={self.sp})"

    def check(self, settings: Any, precision: str) -> None:
        """Nothing beyond the sizes (the host checks them against its world size)."""

    def zero_kwargs(self) -> dict[str, Any]:
        """Nothing: ZeRO shards over ``dp x sp`` (its default ``shard_dims``) with its own reducer."""
        return {}

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """``apply_ulysses`` on every HF model inside ``module``, their loss set to :meth:`loss_function`.

        Args:
            module: the host's model (a LightningModule, the Trainer's model).
            mesh: what ZeRO shards over (unused: the extension's own mesh holds ``sp``).

        Returns:
            ``module``, changed in place.

        Raises:
            ValueError: no HF model and no ``DistributedAttention`` in ``module`` (a custom model
                must wrap its attention itself), or ``module`` already ZeRO-sharded (wrong order).
        """
        models = top_hf_models(module)
        if not models:
            if any(isinstance(m, DistributedAttention) for m in module.modules()):
                return module
            raise ValueError(f"{self.setting}={self.sp}: {type(module).__name__} holds no Hugging Face model and no "
                             "plait.ulysses_sp.DistributedAttention; Ulysses plugs into transformers' "
                             "AttentionInterface. Use an HF model or wrap a custom model's attention in "
                             "DistributedAttention(mesh=...) (plait-ulysses-sp's README).")
        from plait.ulysses_sp.hf import apply_ulysses

        for model in models:
            apply_ulysses(model, self.mesh, config=self.config)
            model.loss_function = self.loss_function
        return module

    def split(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's slice of a causal-LM batch.

        Args:
            batch: ``input_ids`` ``[B, S]``, optional ``labels`` (``-100``: ignored),
                ``attention_mask`` and (``batches="shared"`` only) ``position_ids``.

        Returns:
            ``input_ids``, ``position_ids`` (true positions) and, when labels were given,
            ``labels`` *already shifted* for next-token prediction, each this rank's
            ``[B', S_padded / sp]`` slice (``B' = sp * B`` under ``batches="per_rank"``);
            ``key_padding_mask`` ``[B', S_padded]`` when there is padding attention must not see.

        Raises:
            ValueError: no ``input_ids`` (or, per rank, other keys or unequal batch sizes).
        """
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(f"{self.setting}={self.sp} splits batches along the sequence, so each batch must be a "
                             f"dict with 'input_ids' (and 'labels'); got {kind}.")
        if self.batches == "per_rank":
            batch = gather_group_batch(batch, self.group, self.sp, setting=self.setting)
        return model_inputs(batch, self.mesh)

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
                      num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
                      shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        """The HF models' loss on this rank's slice, labels already shifted by :meth:`split`.

        ``batches="per_rank"`` with the host's ``num_items_in_batch`` (the valid tokens of every
        rank's micro-batches, what HF's own loss divides by): this slice's summed loss divided by
        it, HF's reduction, each token counted on one rank. Otherwise: ulysses-sp's group mean,
        times ``sp`` because ZeRO averages gradients over ``dp x sp``.
        """
        target = shift_labels if shift_labels is not None else labels
        if num_items_in_batch is None or self.batches == "shared":
            return sp_cross_entropy(logits, target, self.mesh, ignore_index=ignore_index, scale=self.sp)
        total = F.cross_entropy(logits.float().flatten(0, 1), target.flatten().to(logits.device),
                                ignore_index=ignore_index, reduction="sum")
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


def remove_sequence_parallel(module: nn.Module) -> nn.Module:
    """Undo :class:`SequenceParallelExtension` on the HF models inside ``module`` (for ``generate`` or
    a plain evaluation after training): their own attention (``remove_ulysses``) and loss function
    back. A no-op where it was not applied.

    Returns:
        ``module``.
    """
    from plait.ulysses_sp.hf import remove_ulysses

    for model in top_hf_models(module):
        loss = vars(model).get("_loss_function")
        if isinstance(getattr(loss, "__self__", None), SequenceParallelExtension):
            del model._loss_function  # back to the class's loss (transformers' loss_function property)
        remove_ulysses(model)
    return module
