"""Sequence parallelism (``sp_size``) and expert parallelism (``ep_size``) for the plait strategies.

Both are :class:`~plait.zero_sharding.composition.ShardingExtension` objects that the strategy adds
to the user's extensions once the process group exists and the mesh is built, so they compose
with ZeRO exactly as any extension does (sequence parallel at order 10, MoE at 20, ZeRO last):

* :class:`SequenceParallel` (plait-ulysses-sp): a ``dp x sp`` mesh (``make_mesh(dp=-1, sp=...)``,
  sp innermost, so ranks ``[i * sp, (i + 1) * sp)`` share their batches); every HF model inside
  the LightningModule gets Ulysses attention through ``apply_ulysses`` and a loss function that
  is ulysses-sp's :func:`~plait.ulysses_sp.sp_cross_entropy` (the valid tokens' losses summed over
  the sp group and divided once, times ``sp`` because ZeRO averages over ``dp x sp``). Batches are
  split along the sequence by :func:`split_batch` (the strategy calls it on every batch).
* :class:`ExpertParallel` (plait-moe-layers): a ``dp x ep`` mesh; ``apply_expert_parallel`` keeps
  ``E / ep`` experts of every plait MoE layer on each rank, and the optimizer's parameter groups are
  split into dense (sharded over every rank) and expert groups (sharded over the
  expert-data-parallel group, with ``zero_global`` naming each local block of experts by its global
  parameter, so checkpoints hold every expert under its global name and shape).

Both packages are optional: they are found with ``importlib.util.find_spec`` and imported only
when ``sp_size``/``ep_size`` is above 1; missing, the strategy fails with the pip line
(:class:`~plait.lightning.pieces.PieceMissingError`) when it is built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from plait.lightning.pieces import PieceMissingError

ULYSSES_INSTALL = "pip install plait-ulysses-sp"
MOE_INSTALL = "pip install plait-moe-layers"
__all__ = ["ExpertParallel", "SequenceParallel", "available", "build_mesh", "check_parallel_sizes", "check_world_size",
           "remove_sequence_parallel", "split_batch"]


def available(module: str) -> bool:
    """Whether the plait piece ``module`` (e.g. ``"plait.ulysses_sp"``) is importable."""
    return importlib.util.find_spec(module) is not None


def _require(module: str, install: str, field: str, value: int) -> None:
    if not available(module):
        package = install.split()[-1]
        raise PieceMissingError(f"{field}={value} needs {package}, which is not installed: {install}")


def check_parallel_sizes(sp_size: Any, ep_size: Any) -> None:
    """Refuse bad ``sp_size``/``ep_size`` values and missing packages (before any process starts).

    Raises:
        ValueError: not a positive int.
        PieceMissingError: plait-ulysses-sp (``sp_size > 1``) or plait-moe-layers (``ep_size > 1``)
            is not installed; the message has the pip line.
    """
    for field, value in (("sp_size", sp_size), ("ep_size", ep_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive int (1: off) dividing the world size.")
    if sp_size > 1:
        _require("plait.ulysses_sp", ULYSSES_INSTALL, "sp_size", sp_size)
    if ep_size > 1:
        _require("plait.moe_layers", MOE_INSTALL, "ep_size", ep_size)


def check_world_size(sp_size: int, ep_size: int, world_size: int) -> None:
    """Refuse an ``sp_size``/``ep_size`` (or their product) that does not divide the world size
    (:func:`plait.kernels.mesh.check_parallel_world`).

    Raises:
        ValueError: naming the field, the world size and the sizes that would work.
    """
    from plait.kernels.mesh import check_parallel_world

    check_parallel_world(sp_size, ep_size, world_size, world="devices x num_nodes")


def build_mesh(sp_size: int, ep_size: int, device_type: str) -> Any:
    """The strategy's ``DeviceMesh`` (:func:`plait.kernels.mesh.parallel_mesh`), or ``None``. Collective."""
    from plait.kernels.mesh import parallel_mesh

    return parallel_mesh(sp_size, ep_size, device_type=device_type)


def sampler_kwargs(kwargs: dict[str, Any], sp_size: int, global_rank: int) -> dict[str, Any]:
    """A strategy's ``distributed_sampler_kwargs`` under ``sp_size``: the sampler splits over the ``dp``
    ranks only, since the ranks of one sp group share their batches."""
    if sp_size > 1:
        kwargs = {**kwargs, "num_replicas": kwargs["num_replicas"] // sp_size, "rank": global_rank // sp_size}
    return kwargs


def split_batch(batch: Any, mesh: Any) -> Any:
    """This rank's part of a causal-LM batch for sequence parallelism.

    Args:
        batch: a mapping with ``input_ids`` ``[B, S]`` and optionally ``labels`` (``-100``: ignored),
            ``attention_mask``, ``position_ids``; every rank of the sp group holds the same one.
        mesh: the ``dp x sp`` mesh.

    Returns:
        The same kind of mapping with ``input_ids``, ``position_ids`` (true positions) and, when
        labels were given, ``labels`` *already shifted* for next-token prediction, each this rank's
        ``[B, S_padded / sp]`` slice; ``key_padding_mask`` ``[B, S_padded]`` when there is padding;
        ``attention_mask`` is dropped (the padding mask replaces it); other keys unchanged.

    Raises:
        ValueError: the batch is not a mapping with ``input_ids``.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"sp_size>1 splits batches along the sequence, so each batch must be a dict with "
                         f"'input_ids' (and 'labels'); got {kind}.")
    from plait.ulysses_sp import shard_batch

    local = shard_batch(dict(batch), mesh)
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "attention_mask", "position_ids")}
    out["input_ids"], out["position_ids"] = local["input_ids"], local["position_ids"]
    if "shift_labels" in local:
        out["labels"] = local["shift_labels"]
    if "key_padding_mask" in local:
        out["key_padding_mask"] = local["key_padding_mask"]
    return type(batch)(out) if type(batch) is not dict and isinstance(batch, dict) else out


def _top_models(module: nn.Module, kind: type) -> list[nn.Module]:
    """Submodules of ``kind`` not nested inside another one (the LightningModule's HF models)."""
    found: list[nn.Module] = []
    for _, sub in module.named_modules():
        if isinstance(sub, kind) and not any(sub in set(top.modules()) for top in found):
            found.append(sub)
    return found


class SequenceParallel:
    """Ulysses over the mesh's ``sp`` dimension, applied to every HF model in the module.

    Args:
        mesh: the ``dp x sp`` mesh.
        config: a ``plait.ulysses_sp.UlyssesConfig`` (``None``: its defaults).
    """

    order = 10

    def __init__(self, mesh: Any, config: Any = None) -> None:
        self.mesh, self.config = mesh, config
        self.sp = mesh["sp"].size()

    def __repr__(self) -> str:
        return f"SequenceParallel(sp={self.sp})"

    def check(self, settings: Any, precision: str) -> None:
        """Nothing beyond the sizes (checked by the strategy)."""

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
                      num_items_in_batch: Any = None, ignore_index: int = -100,
                      shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        """The HF models' loss under SP: ulysses-sp's :func:`~plait.ulysses_sp.sp_cross_entropy` on
        labels already shifted by :func:`split_batch`, scaled by ``sp`` (ZeRO averages over dp x sp)."""
        from plait.ulysses_sp import sp_cross_entropy

        target = shift_labels if shift_labels is not None else labels
        return sp_cross_entropy(logits, target, self.mesh, ignore_index=ignore_index, scale=self.sp)

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """``apply_ulysses`` on every HF model inside ``module`` and their loss set to :meth:`loss_function`.

        Raises:
            ValueError: no HF model and no ``DistributedAttention`` in the module (a custom model must
                wrap its attention itself: see plait-ulysses-sp's README).
        """
        from plait.ulysses_sp import DistributedAttention

        try:
            from transformers import PreTrainedModel
        except ImportError:  # custom models only
            models: list[nn.Module] = []
        else:
            models = _top_models(module, PreTrainedModel)
        if not models:
            if any(isinstance(m, DistributedAttention) for m in module.modules()):
                return module
            raise ValueError(f"sp_size={self.sp}: {type(module).__name__} holds no Hugging Face model and no "
                             "plait.ulysses_sp.DistributedAttention; wrap a custom model's attention in "
                             "DistributedAttention(mesh=trainer.strategy.device_mesh) (plait-ulysses-sp's README).")
        from plait.ulysses_sp.hf import apply_ulysses

        for model in models:
            apply_ulysses(model, self.mesh, config=self.config)
            model.loss_function = self.loss_function
        return module

    def zero_kwargs(self) -> dict[str, Any]:
        """Nothing: ZeRO shards over ``dp x sp`` (its default ``shard_dims``) with its own reducer."""
        return {}


def remove_sequence_parallel(module: nn.Module) -> nn.Module:
    """Undo :class:`SequenceParallel` on the HF models inside ``module`` (for ``generate`` or a plain
    evaluation after training): their own attention (``remove_ulysses``) and loss function back.
    A no-op where it was not applied.

    Returns:
        ``module``.
    """
    from transformers import PreTrainedModel

    from plait.ulysses_sp.hf import remove_ulysses

    for model in _top_models(module, PreTrainedModel):
        loss = vars(model).get("_loss_function")
        if isinstance(getattr(loss, "__self__", None), SequenceParallel):
            del model._loss_function  # back to the class's loss (transformers' loss_function property)
        remove_ulysses(model)
    return module


class ExpertParallel:
    """plait-moe-layers' expert parallelism over the mesh's ``ep`` dimension, composed with ZeRO.

    Args:
        mesh: the ``dp x ep`` mesh.
    """

    order = 20

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.ep = mesh["ep"].size()
        self.groups: Any = None
        self._names: dict[int, str] = {}
        self._module: nn.Module | None = None

    def __repr__(self) -> str:
        return f"ExpertParallel(ep={self.ep})"

    def check(self, settings: Any, precision: str) -> None:
        """Nothing beyond the sizes (checked by the strategy)."""

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Keep this rank's ``E / ep`` experts of every plait MoE layer (``apply_expert_parallel``).

        Raises:
            ValueError: the module has no plait MoE layer, or an expert count not divisible by ``ep_size``.
        """
        from plait.moe_layers import apply_expert_parallel, make_expert_parallel_groups

        self._names = {id(p): n for n, p in module.named_parameters()}  # the optimizer may hold these
        self.groups = make_expert_parallel_groups(self.ep, mesh=self.mesh)
        try:
            apply_expert_parallel(module, self.groups)
        except ValueError as exc:
            raise ValueError(f"ep_size={self.ep}: {exc}") from exc
        self._module = module
        return module

    def regroup(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Split each optimizer group into its dense part and its expert part (the latter sharded over
        the expert-data-parallel group, with its global identity); parameters the expert split
        replaced are mapped to the new ones by name.
        """
        from plait.moe_layers import expert_global_identity, expert_parameters

        assert self._module is not None, "apply() runs before regroup()"
        current = dict(self._module.named_parameters())
        experts = {id(p) for p in expert_parameters(self._module)}
        global_of = expert_global_identity(self._module)  # stacked experts as rows of [E, ...]
        out = []
        for group in param_groups:
            params = [current.get(self._names.get(id(p), ""), p) for p in group["params"]]
            options = {k: v for k, v in group.items() if k != "params"}
            dense = [p for p in params if id(p) not in experts]
            expert = [p for p in params if id(p) in experts]
            if dense:
                out.append({**options, "params": dense})
            if expert:
                out.append({**options, "params": expert, "zero_group": self.groups.edp_group,
                            "zero_global": global_of})
        return out

    def zero_kwargs(self) -> dict[str, Any]:
        """Nothing engine-wide: the groups come through :meth:`regroup` (the optimizer's own groups, split)."""
        return {}
