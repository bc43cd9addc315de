"""torch tensor-parallel styles for Hugging Face ``Conv1D`` layers (GPT-2 and its family).

torch's ``ColwiseParallel`` / ``RowwiseParallel`` (``torch.distributed.tensor.parallel``) accept only
``nn.Linear`` and ``nn.Embedding``. HF's ``Conv1D`` computes ``x @ weight + bias`` with ``weight``
stored ``[in, out]``: an ``nn.Linear`` weight transposed. The two styles here run torch's own input
and output hooks with the placements transposed: column-parallel is ``Shard(1)`` of the weight (and
``Shard(0)`` of the bias), row-parallel ``Shard(0)`` of the weight (the bias replicated)::

    from torch.distributed.tensor.parallel import parallelize_module
    from plait.universal_ckpt.parallel_styles import Conv1DColwiseParallel, Conv1DRowwiseParallel

    c_attn = Conv1DColwiseParallel(parts=(n_embd,) * 3)             # GPT-2's fused [q|k|v]
    plan = {f"transformer.h.{i}.attn.c_attn": c_attn for i in range(n_layer)}
    plan |= {f"transformer.h.{i}.attn.c_proj": Conv1DRowwiseParallel() for i in range(n_layer)}
    plan |= {f"transformer.h.{i}.mlp.c_fc": Conv1DColwiseParallel() for i in range(n_layer)}
    plan |= {f"transformer.h.{i}.mlp.c_proj": Conv1DRowwiseParallel() for i in range(n_layer)}
    model = parallelize_module(model, mesh, plan)
    for block in model.transformer.h:                               # the rank's heads
        block.attn.split_size, block.attn.num_heads = n_embd // tp, n_head // tp
    rules = c_attn.checkpoint_rules(r".*attn\\.c_attn", unit=n_embd // n_head)
    uc.save({"model": uc.model_parallel(model, optimizer, config=uc.ModelParallelConfig(
        groups={"tp": tp_ranks}, rules=rules))}, "ckpts/", step=step)

A fused weight (``parts``: GPT-2's ``c_attn`` ``[q|k|v]``) must give rank r ``[q_r|k_r|v_r]`` so that
each rank's attention sees whole heads of q, k and v. No DTensor placement of the consolidated
tensor describes that: the local shard is built part by part and wrapped as ``Shard(1)``, so the
DTensor's "global" view is a permutation of HF's tensor. A checkpoint therefore needs the
style's :meth:`Conv1DColwiseParallel.checkpoint_rules` (a :class:`~plait.universal_ckpt.TensorLayout`
with ``parts``); saved by its placement alone, the q/k/v columns land on the wrong ranks (the
tests show the logits go wrong).

Importing this module imports ``torch.distributed.tensor.parallel``; the package itself does not.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from plait.universal_ckpt.layouts import TensorLayout


def _check_conv1d(style: str, module: nn.Module) -> None:
    weight = getattr(module, "weight", None)
    if type(module).__name__ != "Conv1D" or weight is None or weight.dim() != 2:
        raise ValueError(f"{style} is for HF Conv1D layers (weight [in, out]); got {type(module).__name__}. "
                         "Use torch's ColwiseParallel / RowwiseParallel for nn.Linear and nn.Embedding.")


def _parameter(value: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(value, requires_grad=like.requires_grad)


def _distribute(style, param: torch.Tensor, device_mesh, placement) -> torch.Tensor:
    """``distribute_tensor`` from the style's source rank (``src_data_rank``, torch >= 2.7; rank 0 before)."""
    if hasattr(style, "src_data_rank"):
        return distribute_tensor(param, device_mesh, [placement], src_data_rank=style.src_data_rank)
    return distribute_tensor(param, device_mesh, [placement])


class Conv1DColwiseParallel(ColwiseParallel):
    """Column-parallel HF ``Conv1D``: the output features split over the mesh.

    The weight ``[in, out]`` is ``Shard(1)``, the bias ``Shard(0)``; inputs and outputs follow
    torch's ``ColwiseParallel`` (replicated in, sharded on the last dim out, by default).

    Args:
        parts: widths of fused sub-parameters along the output features (GPT-2's ``c_attn``:
            ``(n_embd,) * 3``), each split separately so rank r holds ``[q_r|k_r|v_r]``; they
            must sum to the layer's output features and each be divisible by the mesh size.
            None: one block.
        input_layouts, output_layouts, use_local_output: as torch's ``ColwiseParallel``.
    """

    def __init__(self, *, parts: tuple[int, ...] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if parts is not None and (not parts or any(not isinstance(w, int) or w < 1 for w in parts)):
            raise ValueError(f"Conv1DColwiseParallel(parts={parts!r}): give positive widths, e.g. (768, 768, 768).")
        self.parts = tuple(parts) if parts is not None else None

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = 1 if pname == "weight" else 0  # the output features
            if self.parts is None:
                value = _distribute(self, param.detach(), device_mesh, Shard(dim))
            else:
                value = DTensor.from_local(self._fused_shard(name, param.detach(), dim, device_mesh), device_mesh,
                                           [Shard(dim)], run_check=False)
            module.register_parameter(pname, _parameter(value, param))

    def _fused_shard(self, name: str, full: torch.Tensor, dim: int, device_mesh) -> torch.Tensor:
        """Rank r's ``[p0_r|p1_r|...]``: each part split on its own."""
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        if sum(self.parts) != full.shape[dim] or any(w % size for w in self.parts):
            raise ValueError(f"{name or 'Conv1D'}: parts={list(self.parts)} must sum to its {full.shape[dim]} output "
                             f"features and each be divisible by the mesh size {size}; fix parts or the TP size.")
        return torch.cat([part.chunk(size, dim)[rank] for part in full.split(list(self.parts), dim)], dim).clone()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_conv1d(type(self).__name__, module)
        return distribute_module(module, device_mesh, self._partition_conv1d_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    def checkpoint_rules(self, module_regex: str, *, unit: int = 1) -> tuple[tuple[str, TensorLayout], ...]:
        """The :class:`~plait.universal_ckpt.ModelParallelConfig` rules for layers under this style.

        Args:
            module_regex: a regex fully matching the layers' module names (``r".*attn\\.c_attn"``).
            unit: rows of one head in each part (``head_dim``), so a TP size that splits a head is
                refused at save and load.

        Returns:
            ``((weight regex, layout), (bias regex, layout))`` for a fused style; empty without
            ``parts`` (the DTensor placements then describe themselves).
        """
        if self.parts is None:
            return ()
        return ((rf"{module_regex}\.weight", TensorLayout(dim=1, parts=self.parts, unit=unit)),
                (rf"{module_regex}\.bias", TensorLayout(dim=0, parts=self.parts, unit=unit)))


class Conv1DRowwiseParallel(RowwiseParallel):
    """Row-parallel HF ``Conv1D``: the input features split over the mesh.

    The weight ``[in, out]`` is ``Shard(0)``, the bias replicated (added once, after the
    reduction); inputs sharded on the last dim in, replicated out by default, as torch's
    ``RowwiseParallel``.

    Args:
        input_layouts, output_layouts, use_local_output: as torch's ``RowwiseParallel``.
    """

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if pname == "weight" else Replicate()
            value = _distribute(self, param.detach(), device_mesh, placement)
            module.register_parameter(pname, _parameter(value, param))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_conv1d(type(self).__name__, module)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition_conv1d_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
