"""Activation checkpointing per decoder block, made to work with ZeRO-3's gathers.

:func:`checkpoint_blocks` wraps the forward of every child of the model's ``nn.ModuleList``\\ s
(the decoder blocks: the same modules ZeRO-3 makes its gather units) in torch's non-reentrant
``torch.utils.checkpoint``. Forward then keeps only each block's input; the block's inner
activations exist for one block at a time, in forward and again when backward recomputes them.

Why the forward is wrapped on the instance and not the module replaced: parameter names, and
so state dicts and checkpoints, stay the same, and ZeRO-3's hooks stay on the block's
``__call__``. In forward the block's unit is gathered by its pre-forward hook and released by
its post-forward hook as usual. In backward the unit's pre-backward hook (on the block's output)
gathers it again before autograd reaches the block's saved tensors, whose first unpacking runs
the recompute; the unit is released again once its gradients are reduced. So the recompute
reads the gathered weights and holds one unit, as the backward itself does.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

_MARK = "_plait_checkpointed"


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every ``nn.ModuleList`` in ``model`` (its decoder blocks), in order.

    Args:
        model: any module (sharded or not).

    Returns:
        The blocks; a module listed twice (shared) once.
    """
    seen: dict[int, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                seen.setdefault(id(child), child)
    return list(seen.values())


def checkpoint_blocks(model: nn.Module, *, blocks: Iterable[nn.Module] | None = None) -> int:
    """Checkpoint each decoder block's activations (``torch.utils.checkpoint``, non-reentrant).

    Works on a plain model and on one sharded by ``zero_shard`` (before or after sharding) at
    any stage; the losses and gradients are the same as without checkpointing (bitwise on the
    CPU: the recompute runs the same kernels on the same inputs). Idempotent.

    Args:
        model: the model.
        blocks: the modules to checkpoint; default :func:`decoder_blocks` (every
            ``nn.ModuleList`` child).

    Returns:
        How many blocks are checkpointed now.

    Raises:
        ValueError: ``blocks`` is empty or the model has no ``nn.ModuleList`` (nothing to
            checkpoint), or a block is not a submodule of ``model``.
    """
    chosen = decoder_blocks(model) if blocks is None else list(blocks)
    if not chosen:
        raise ValueError("checkpoint_blocks: no blocks to checkpoint (the model has no nn.ModuleList); "
                         "pass blocks=[...] with the modules whose activations to recompute.")
    inside = {id(m) for m in model.modules()}
    for block in chosen:
        if id(block) not in inside:
            raise ValueError(f"checkpoint_blocks: blocks holds a {type(block).__name__} that is not a submodule "
                             "of model; pass model's own modules.")
    for block in chosen:
        if not hasattr(block, _MARK):
            _wrap(block)
    return len(chosen)


def uncheckpoint_blocks(model: nn.Module) -> int:
    """Undo :func:`checkpoint_blocks` on every module of ``model``.

    Returns:
        How many blocks were unwrapped.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, _MARK):
            previous = getattr(module, _MARK)
            del module.forward
            if previous is not None:  # an instance forward it had before (e.g. a tiled MLP)
                module.forward = previous
            delattr(module, _MARK)
            count += 1
    return count


def _wrap(block: nn.Module) -> None:
    previous = vars(block).get("forward")  # kept so that uncheckpoint_blocks restores it
    inner = block.forward  # bound: an instance forward set before (a tiled MLP) is kept inside

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved for backward: no need to recompute
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = types.MethodType(forward, block)
    setattr(block, _MARK, previous)
