"""Expert parallelism as a ZeRO sharding extension: what the Lightning and HF Trainer integrations add for ``ep_size``.

plait-zero-sharding composes features through small *extension* objects (its
``composition.ShardingExtension`` protocol: ``order``, ``check``, ``apply``, ``zero_kwargs``, and
optionally ``regroup`` for the optimizer's parameter groups), applied in the design's fixed order
(sequence parallel at 10, MoE at 20, ZeRO last). This module is that extension for expert
parallelism, so the integrations only translate their host's settings into
:class:`ExpertParallelExtension`'s arguments. The protocol is matched by shape: nothing here
imports zero-sharding.

* :meth:`~ExpertParallelExtension.apply`: HF sparse-MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE,
  PhiMoE) are converted to plait MoE layers first when the model has no plait layer
  (:func:`~plait.moe_layers.hf.convert_hf_moe`: same parameters, same logits), then every rank
  keeps ``E / ep`` experts of each layer (:func:`~plait.moe_layers.apply_expert_parallel`).
* :meth:`~ExpertParallelExtension.regroup`: each optimizer parameter group is split into its dense
  part (sharded over every rank) and its expert part (sharded over the expert-data-parallel group,
  ``zero_global`` naming each local block of experts as rows of its global tensor, so checkpoints
  hold every expert under its global name and shape and reshard across ep sizes). Converted
  parameters keep their HF names there (:attr:`~ExpertParallelExtension.hf_names`; HF's ``gate``
  for the plait router), so exports load with ``from_pretrained``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.moe_layers.identity import expert_global_identity
from plait.moe_layers.layer import moe_layers
from plait.moe_layers.parallel import apply_expert_parallel, expert_parameters, make_expert_parallel_groups

Identity = tuple[str, tuple[int, ...], int]


class ExpertParallelExtension:
    """plait-moe-layers' expert parallelism over the mesh's ``ep`` dimension, composed with ZeRO.

    Example (what an integration does once the process group and mesh exist)::

        ext = ExpertParallelExtension(make_mesh(dp=-1, ep=2), setting="ep_size")
        model = ext.apply(model, mesh)
        groups = ext.regroup(optimizer.param_groups)    # -> zero_shard(..., param_groups=groups)

    Args:
        mesh: a ``DeviceMesh`` with an ``ep`` dimension.
        setting: how the host names the ep size in error messages (``"ep_size"``,
            ``"PlaitConfig.ep_size"``).

    Attributes:
        groups: the :class:`~plait.moe_layers.ExpertParallelGroups` (after :meth:`apply`).
        hf_names: plait parameter name -> the converted HF block's name (empty when nothing was
            converted); checkpoints and exports use the HF names.
    """

    order = 20  # docs/architecture.md's order: sequence parallel (10) -> MoE -> checkpointing/offload -> ZeRO

    def __init__(self, mesh: Any, *, setting: str = "ep_size") -> None:
        self.mesh, self.setting = mesh, setting
        self.ep = mesh["ep"].size()
        self.groups: Any = None
        self.hf_names: dict[str, str] = {}
        self._names: dict[int, str] = {}
        self._module: nn.Module | None = None

    def __repr__(self) -> str:
        return f"ExpertParallel(ep={self.ep})"

    def check(self, settings: Any, precision: str) -> None:
        """Nothing beyond the sizes (the host checks them against its world size)."""

    def zero_kwargs(self) -> dict[str, Any]:
        """Nothing engine-wide: the groups come through :meth:`regroup` (the optimizer's own groups, split)."""
        return {}

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Convert HF sparse-MoE blocks where there is no plait MoE layer yet, then keep this rank's
        ``E / ep`` experts of every layer.

        Args:
            module: the host's model.
            mesh: what ZeRO shards over (unused: the extension's own mesh holds ``ep``).

        Returns:
            ``module``, changed in place.

        Raises:
            ValueError: no MoE layer (plait or HF), or an expert count ``ep`` does not divide
                (the message starts with :attr:`setting`).
        """
        if not moe_layers(module):
            self._convert_hf(module)
        self._names = {id(p): n for n, p in module.named_parameters()}  # the optimizer may hold these
        self.groups = make_expert_parallel_groups(self.ep, mesh=self.mesh)
        try:
            apply_expert_parallel(module, self.groups)
        except ValueError as exc:
            raise ValueError(f"{self.setting}={self.ep}: {exc}") from exc
        self._module = module
        return module

    def _convert_hf(self, module: nn.Module) -> None:
        from plait.moe_layers.hf import SUPPORTED_BLOCKS, convert_hf_moe

        if not any(type(m).__name__ in SUPPORTED_BLOCKS for m in module.modules()):
            raise ValueError(f"{self.setting}={self.ep}: {type(module).__name__} has no plait MoE layer and no HF "
                             f"{' / '.join(SUPPORTED_BLOCKS)}; expert parallelism needs an MoE model.")
        before = {id(p): n for n, p in module.named_parameters()}
        convert_hf_moe(module)  # the plait layers share the HF parameters: map their names back
        self.hf_names = {n: before[id(p)] for n, p in module.named_parameters() if before.get(id(p), n) != n}

    def regroup(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Split each optimizer group into its dense part and its expert part.

        Parameters the expert split replaced are mapped to the new ones by name. Expert parts are
        sharded over the expert-data-parallel group with each local block's global identity;
        with converted HF blocks every part is named as in the HF model.

        Args:
            param_groups: the optimizer's groups (``params`` plus options), as the user built them.

        Returns:
            The groups for ``zero_shard(param_groups=...)``.
        """
        if self._module is None:
            raise RuntimeError("ExpertParallelExtension.regroup() runs after apply() (zero-sharding's order).")
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
                named = {"zero_global": self._dense_identity} if self.hf_names else {}
                out.append({**options, "params": dense, **named})
            if expert:
                out.append({**options, "params": expert, "zero_group": self.groups.edp_group,
                            "zero_global": self._expert_identity(global_of)})
        return out

    def _dense_identity(self, name: str, shape: tuple[int, ...]) -> Identity:
        """A dense parameter's checkpoint/export identity: its HF name (the router is HF's ``gate``)."""
        return self.hf_names.get(name, name), tuple(shape), 0

    def _expert_identity(self, global_of: Any) -> Any:
        """Each local expert block as rows of its global tensor, named as in the HF model when converted."""
        if not self.hf_names:
            return global_of

        def identity(name: str, shape: tuple[int, ...]) -> Identity:
            global_name, global_shape, row = global_of(name, shape)
            return self.hf_names.get(global_name, global_name), global_shape, row

        return identity
