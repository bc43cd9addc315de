"""Sequence parallelism (``sp_size``) and expert parallelism (``ep_size``) under the HF Trainer.

Both are :class:`~plait.zero_sharding.composition.ShardingExtension` objects that the Trainer adds
to the config's extensions once the process group exists, so they compose with ZeRO as any
extension does (sequence parallel at order 10, MoE at 20, ZeRO last), on the mesh
:func:`build_mesh` makes (``dp x ep x sp``, sp innermost: an sp group is consecutive ranks).

* :class:`SequenceParallel` (plait-ulysses-sp): the Trainer shards its data over every rank as
  without sp; each micro-batch of an sp group is gathered (:func:`gather_group_batch`) and every
  rank keeps its slice of the sequence of the whole group batch (ulysses-sp's ``shard_batch``:
  true position ids, labels shifted before slicing). The same tokens as without sp are trained on
  per step, each by one rank, so the Trainer's sizes (``num_items_in_batch``, total batch size,
  epochs) stay as they are, and the curve is the same Trainer's without sp. The HF model gets
  Ulysses attention (``apply_ulysses``) and a loss on the pre-shifted labels (:meth:`loss_function`).
* :class:`ExpertParallel` (plait-moe-layers): HF sparse-MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE)
  are converted to plait MoE layers (``convert_hf_moe``, same parameters, same logits), each rank
  keeps ``E / ep`` experts of each layer (``apply_expert_parallel``), and :meth:`ExpertParallel.regroup`
  splits the Trainer's optimizer groups into dense ones (sharded over every rank) and expert ones
  (sharded over the expert-data-parallel group, named by their global tensors). Checkpoints and
  ``save_model()`` name every converted parameter as the HF model does (HF's ``gate`` for the
  plait router), so ``from_pretrained`` loads the export.

The Lightning integration has the same two extensions for its strategies; the rules they share
(sizes dividing the world, mesh layout) are the feature packages' own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import collectives

INSTALL = {"sp_size": ("plait.ulysses_sp", "plait-ulysses-sp", "sp"),
           "ep_size": ("plait.moe_layers", "plait-moe-layers", "moe")}
# Keys of a causal-LM micro-batch that are gathered across the sp group, with their padding value.
BATCH_PAD = {"input_ids": 0, "labels": -100, "attention_mask": 0}
IGNORE_INDEX = -100


def check_installed(field: str, value: int) -> None:
    """Raise now when ``sp_size``/``ep_size`` above 1 needs a package that is not installed.

    Raises:
        ImportError: with the pip line.
    """
    module, package, extra = INSTALL[field]
    if value > 1 and importlib.util.find_spec(module) is None:
        raise ImportError(f"PlaitConfig.{field}={value} needs {package}, which is not installed: pip install "
                          f"{package}  (or: pip install 'plait-transformers[{extra}]')")


def check_world_size(sp_size: int, ep_size: int, world_size: int) -> None:
    """Refuse sizes that do not divide the world size (:func:`plait.kernels.mesh.check_parallel_world`).

    Raises:
        ValueError: naming the field, the world size and the sizes that would work.
    """
    from plait.kernels.mesh import check_parallel_world

    check_parallel_world(sp_size, ep_size, world_size, field_prefix="PlaitConfig.", world="the launcher's processes")


def build_mesh(sp_size: int, ep_size: int, device_type: str) -> Any:
    """The ``DeviceMesh`` ``("dp", ["ep",] ["sp"])`` (:func:`plait.kernels.mesh.parallel_mesh`), or
    ``None`` when both sizes are 1. Collective."""
    from plait.kernels.mesh import parallel_mesh

    return parallel_mesh(sp_size, ep_size, device_type=device_type)


def _top_models(module: nn.Module) -> list[nn.Module]:
    """The HF models in ``module`` not nested in another one (the Trainer's model itself, usually)."""
    from transformers import PreTrainedModel

    found: list[nn.Module] = []
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and not any(sub in set(top.modules()) for top in found):
            found.append(sub)
    return found


def gather_group_batch(inputs: Mapping[str, Any], group: Any, sp: int) -> dict[str, torch.Tensor]:
    """The micro-batches of the sp group's ranks, concatenated along the batch (rank order).

    Sequences are padded to the group's longest (``input_ids`` 0, ``labels`` -100, an
    ``attention_mask`` of 0, made when missing) so that every rank's rows line up.

    Raises:
        ValueError: a key other than ``input_ids``/``labels``/``attention_mask``, or batch sizes
            that differ across the group.
    """
    extra = sorted(k for k in inputs if k not in BATCH_PAD and k != "num_items_in_batch")
    if "input_ids" not in inputs or extra:
        raise ValueError(f"PlaitConfig.sp_size={sp} splits causal-LM batches along the sequence: each batch must hold "
                         f"input_ids (and labels, attention_mask) only; got {sorted(inputs)}. Drop the other keys in "
                         "the data collator.")
    ids = inputs["input_ids"]
    shape = torch.tensor(ids.shape, dtype=torch.int64)
    shapes = torch.empty(sp * 2, dtype=torch.int64)
    collectives.all_gather_into_tensor(shapes, shape, group=group, name="Ulysses batch shapes all-gather")
    shapes = shapes.view(sp, 2)
    if len(set(shapes[:, 0].tolist())) > 1:
        raise ValueError(f"PlaitConfig.sp_size={sp}: the sp group's micro-batches have {shapes[:, 0].tolist()} rows; "
                         "they must be equal. Keep accelerate's even_batches (the default) or set "
                         "dataloader_drop_last=True.")
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


class SequenceParallel:
    """Ulysses over the mesh's ``sp`` dimension for the HF model the Trainer trains.

    Args:
        mesh: the mesh with an ``sp`` dimension.
        config: a ``plait.ulysses_sp.UlyssesConfig`` (``None``: its defaults).
    """

    order = 10

    def __init__(self, mesh: Any, config: Any = None) -> None:
        self.mesh, self.config = mesh, config
        self.sp = mesh["sp"].size()
        self.group = mesh["sp"].get_group()

    def __repr__(self) -> str:
        return f"SequenceParallel(sp={self.sp})"

    def check(self, settings: Any, precision: str) -> None:
        """Nothing beyond the sizes (checked by the Trainer)."""

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """``apply_ulysses`` on the HF model and its loss set to :meth:`loss_function`.

        Raises:
            ValueError: the Trainer's model holds no HF ``PreTrainedModel``.
        """
        from plait.ulysses_sp.hf import apply_ulysses

        models = _top_models(module)
        if not models:
            raise ValueError(f"PlaitConfig.sp_size={self.sp}: {type(module).__name__} is not a Hugging Face "
                             "PreTrainedModel; Ulysses plugs into transformers' AttentionInterface. Use an HF model "
                             "or wrap a custom model's attention in plait.ulysses_sp.DistributedAttention yourself.")
        for model in models:
            apply_ulysses(model, self.mesh, config=self.config)
            model.loss_function = self.loss_function
        return module

    def zero_kwargs(self) -> dict[str, Any]:
        """Nothing: ZeRO shards over ``dp x sp`` with its own reducer."""
        return {}

    def split(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's slice of the sp group's micro-batch (see the module docstring)."""
        from plait.ulysses_sp import shard_batch

        local = shard_batch(gather_group_batch(inputs, self.group, self.sp), self.mesh)
        out = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
        if "shift_labels" in local:
            out["labels"] = local["shift_labels"]  # already shifted: loss_function does not shift again
        if "key_padding_mask" in local:
            out["key_padding_mask"] = local["key_padding_mask"]
        return out

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                      num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX, **_: Any) -> torch.Tensor:
        """The HF model's loss on this rank's slice with labels already shifted by :meth:`split`.

        With the Trainer's ``num_items_in_batch`` (the valid tokens of every rank's micro-batches,
        what HF's own loss divides by): this slice's summed loss divided by it, exactly HF's
        reduction, each token counted on one rank. Without it: ulysses-sp's group mean, times
        ``sp`` because ZeRO averages gradients over ``dp x sp``.
        """
        if num_items_in_batch is None:
            from plait.ulysses_sp import sp_cross_entropy

            return sp_cross_entropy(logits, labels, self.mesh, ignore_index=ignore_index, scale=self.sp)
        total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().to(logits.device),
                                ignore_index=ignore_index, reduction="sum")
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


class ExpertParallel:
    """plait-moe-layers' expert parallelism over the mesh's ``ep`` dimension, composed with ZeRO.

    Args:
        mesh: the mesh with an ``ep`` dimension.
    """

    order = 20

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.ep = mesh["ep"].size()
        self.groups: Any = None
        self._names: dict[int, str] = {}
        # plait layer name -> the converted HF block's name (checkpoints and save_model() use the latter)
        self.hf_names: dict[str, str] = {}
        self._module: nn.Module | None = None

    def __repr__(self) -> str:
        return f"ExpertParallel(ep={self.ep})"

    def _dense_identity(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
        """A dense parameter's checkpoint/export identity: its HF name (the router is HF's ``gate``)."""
        return self.hf_names.get(name, name), tuple(shape), 0

    def _expert_identity(self, global_of: Any) -> Any:
        """Each local expert block as rows of its global tensor, named as in the HF model."""
        def identity(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
            global_name, global_shape, row = global_of(name, shape)
            return self.hf_names.get(global_name, global_name), global_shape, row

        return identity

    def check(self, settings: Any, precision: str) -> None:
        """Nothing beyond the sizes (checked by the Trainer)."""

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Convert HF sparse-MoE blocks to plait MoE layers where there are no plait layers yet, then
        keep this rank's ``E / ep`` experts of each.

        Raises:
            ValueError: no MoE layer (plait or HF), or an expert count ``ep_size`` does not divide.
        """
        from plait.moe_layers import apply_expert_parallel, make_expert_parallel_groups, moe_layers

        if not moe_layers(module):
            from plait.moe_layers.hf import SUPPORTED_BLOCKS, convert_hf_moe

            if not any(type(m).__name__ in SUPPORTED_BLOCKS for m in module.modules()):
                raise ValueError(f"PlaitConfig.ep_size={self.ep}: {type(module).__name__} has no plait MoE layer and "
                                 f"no HF {' / '.join(SUPPORTED_BLOCKS)}; expert parallelism needs an MoE model.")
            hf_names = {id(p): n for n, p in module.named_parameters()}
            convert_hf_moe(module)  # the plait layers share the HF parameters: map their names back
            self.hf_names = {n: hf_names[id(p)] for n, p in module.named_parameters()
                             if hf_names.get(id(p), n) != n}
        self._names = {id(p): n for n, p in module.named_parameters()}
        self.groups = make_expert_parallel_groups(self.ep, mesh=self.mesh)
        try:
            apply_expert_parallel(module, self.groups)
        except ValueError as exc:
            raise ValueError(f"PlaitConfig.ep_size={self.ep}: {exc}") from exc
        self._module = module
        return module

    def regroup(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Split each optimizer group into its dense part and its expert part (sharded over the
        expert-data-parallel group, with each local block's global identity)."""
        from plait.moe_layers import expert_global_identity, expert_parameters

        assert self._module is not None, "apply() runs before regroup()"
        current = dict(self._module.named_parameters())
        experts = {id(p) for p in expert_parameters(self._module)}
        global_of = expert_global_identity(self._module)
        out = []
        for group in param_groups:
            params = [current.get(self._names.get(id(p), ""), p) for p in group["params"]]
            options = {k: v for k, v in group.items() if k != "params"}
            dense = [p for p in params if id(p) not in experts]
            expert = [p for p in params if id(p) in experts]
            if dense:
                # Checkpoints and save_model() name converted parameters as the HF model does, so
                # from_pretrained (and any HF-keyed loader) reads them.
                named = {"zero_global": self._dense_identity} if self.hf_names else {}
                out.append({**options, "params": dense, **named})
            if expert:
                out.append({**options, "params": expert, "zero_group": self.groups.edp_group,
                            "zero_global": self._expert_identity(global_of)})
        return out

    def zero_kwargs(self) -> dict[str, Any]:
        """Nothing engine-wide: the groups come through :meth:`regroup`."""
        return {}
