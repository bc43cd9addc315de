"""Activation checkpointing whose saved layer inputs live in host memory between forward and backward.

A checkpointed layer keeps only its input; over a long sequence those inputs (``[B, S, h]`` per
layer) are what is left of the activations, and ALST moves them to the host. Here the forward
runs under ``no_grad``, copies the input to CPU (pinned, non-blocking when it comes from an
accelerator) and keeps nothing on the device; backward copies it back, recomputes the layer with
grad and back-propagates through it, like torch's reentrant checkpoint. Tiled MLPs inside the layer
(:func:`plait.ulysses_sp.tile_mlp`) keep their forward output on the host too
(:class:`plait.ulysses_sp.tiled.TiledReplay`), so the recompute rebuilds their graph without
running them: an MLP runs twice per step (forward, and chunk by chunk in backward), as an untiled
checkpointed MLP does, instead of three times. On a CPU-only machine the
"host copy" is a second CPU tensor, so memory is not saved there: the benefit is accelerator
memory, which this machine cannot show (see the README's limits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.ulysses_sp.tiled import TiledReplay


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned and asynchronous from CUDA; a plain copy on CPU)."""
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
    return tensor.detach().clone()


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable, x: torch.Tensor, *args: Any) -> torch.Tensor:
        ctx.fn, ctx.args, ctx.device = fn, args, x.device
        ctx.host_input = to_host(x)
        ctx.rng = torch.get_rng_state()
        # tiled MLPs inside keep their outputs (on the host) so the recompute does not run them again
        ctx.replay = TiledReplay(keep=to_host, fetch=lambda kept, like: kept.to(like.device, non_blocking=True))
        with ctx.replay:
            out = fn(x, *args)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"offloaded_checkpoint needs fn to return one tensor, got {type(out).__name__}.")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x = ctx.host_input.to(ctx.device, non_blocking=True).requires_grad_(True)
        ctx.host_input = None
        state = torch.get_rng_state()
        torch.set_rng_state(ctx.rng)  # dropout masks as in forward
        try:
            with torch.enable_grad(), ctx.replay:
                out = ctx.fn(x, *ctx.args)
        finally:
            torch.set_rng_state(state)
            ctx.replay = None
        torch.autograd.backward(out, grad)
        return (None, x.grad, *([None] * len(ctx.args)))


def offloaded_checkpoint(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``fn(x, *args)`` checkpointed, with ``x`` kept on the host until backward.

    Parameter gradients accumulate into ``.grad`` during backward (as with torch's reentrant
    checkpoint); other tensor ``args`` get no gradient.

    Args:
        fn: the layer call, returning one tensor.
        x: the layer input (the only saved tensor).
        *args: further positional arguments (position embeddings, masks).

    Returns:
        ``fn(x, *args)``.
    """
    if not torch.is_grad_enabled():
        return fn(x, *args)
    return _OffloadedCheckpoint.apply(fn, x, *args)


def enable_offloaded_checkpointing(model: nn.Module) -> int:
    """Checkpoint every HF decoder layer with :func:`offloaded_checkpoint` (transformers' own switch).

    Uses ``model.gradient_checkpointing_enable()`` and then points every
    ``GradientCheckpointingLayer``'s checkpoint function at :func:`offloaded_checkpoint`.

    Args:
        model: a transformers ``PreTrainedModel`` that supports gradient checkpointing.

    Returns:
        How many layers now offload their checkpoints.

    Raises:
        ValueError: the model has no ``GradientCheckpointingLayer`` (named).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer to checkpoint.")
    for layer in layers:
        layer._gradient_checkpointing_func = offloaded_checkpoint
    return len(layers)
