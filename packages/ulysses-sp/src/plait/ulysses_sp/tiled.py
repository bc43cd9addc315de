"""ALST's tiling: run a sequence-local function chunk by chunk, keep only its input, recompute in backward.

An MLP or the logits + cross-entropy act on every token independently, so splitting the
sequence changes nothing but the peak: the ``[S, intermediate]`` MLP activations and the
``[S, vocab]`` logits (the largest tensors of a long-sequence step) exist one chunk at a time, in
forward and in backward. :class:`_TiledRecompute` is the one mechanism: forward under
``no_grad`` chunk by chunk, saving the input only; backward recomputes each chunk with grad and
asks ``torch.autograd.grad`` for the input's and the parameters' gradients, summed over chunks.
Parameter gradients are returned once per backward (not accumulated per chunk), so per-parameter
gradient hooks (ZeRO's reduce) fire once, as they would untiled. Inside an offloaded checkpoint
the layer's recompute reuses the tiled output of its first run (:class:`TiledReplay`) instead of
running the function a third time.

The loss needs no recompute: it is the last op, so the gradient of the summed cross-entropy with
respect to each chunk's logits (softmax minus one-hot) is known in forward.
:class:`_FusedLinearCrossEntropy` computes it there, chunk by chunk, and turns it into the hidden
states' and the head's gradients at once; backward only scales them by the incoming scalar. That
saves the second logits matmul and softmax per chunk (the vocabulary projection is the largest
matmul of a small-hidden, large-vocabulary model). What it keeps until backward is ``[B, S, h]``
and the head's gradient, never logits. :func:`tile_lm_head` is the other trade, for a head sharded
by ZeRO-3: the loss through :func:`tiled_apply` inside the head's own call, so nothing of the
head's size is kept between forward and backward, at the price of recomputing each chunk's logits.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.ulysses_sp.sharding import IGNORE_INDEX


def chunk_sizes(length: int, chunks: int) -> list[int]:
    """``length`` split into ``min(chunks, length)`` near-equal sizes (the first ones one larger)."""
    chunks = max(1, min(chunks, length))
    base, extra = divmod(length, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


class TiledReplay:
    """What the tiled calls (and FPDT attention) inside a checkpointed layer computed in forward, for its recompute.

    A checkpoint (:func:`plait.ulysses_sp.offloaded_checkpoint`) runs its layer twice: once
    without grad in forward, once with grad in backward to rebuild the graph. A tiled call inside
    it saves only its input and recomputes each chunk in its own backward, so without this its
    function would run three times. Here the first run keeps each tiled call's output (through
    ``keep``, e.g. to the host), and the recompute returns that output instead of computing it
    again; the chunks are still recomputed one at a time in backward, so the memory stays a
    chunk's. FPDT's attention (:mod:`plait.ulysses_sp.fpdt`) keeps its output and log-sum-exp
    the same way, so the recompute skips the attention blocks and only the backward visits them.
    The calls are matched in order (the recompute replays the same ops); a call whose
    shape does not match is computed as usual.

    Args:
        keep: stores an output until the recompute (e.g. a host copy).
        fetch: brings a kept output back next to its input (``fetch(kept, like)``).
    """

    def __init__(self, keep: Callable[[torch.Tensor], torch.Tensor],
                 fetch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.keep, self.fetch = keep, fetch
        self.outputs: list[tuple[tuple, Any]] = []
        self.replaying = False

    def __enter__(self) -> TiledReplay:
        _REPLAYS.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _REPLAYS.stack.pop()
        if self.replaying:
            self.outputs.clear()  # the recompute is done: nothing is kept past it
        self.replaying = True  # the next time this replay is entered it hands outputs back

    def put(self, key: tuple, out: Any) -> None:
        """Record a call's output (a tensor or a tuple of them) under ``key`` (what identifies the call)."""
        kept = tuple(self.keep(t) for t in out) if isinstance(out, tuple) else self.keep(out)
        self.outputs.append((key, kept))

    def take(self, key: tuple, like: torch.Tensor) -> Any:
        """The next recorded output if it was recorded under ``key`` (else ``None``: compute it)."""
        if not self.outputs or self.outputs[0][0] != key:
            return None
        kept = self.outputs.pop(0)[1]
        return tuple(self.fetch(t, like) for t in kept) if isinstance(kept, tuple) else self.fetch(kept, like)


class _ReplayStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[TiledReplay] = []


_REPLAYS = _ReplayStack()


def active_replay() -> TiledReplay | None:
    """The innermost :class:`TiledReplay` this thread is inside (``None`` outside any checkpoint)."""
    return _REPLAYS.stack[-1] if _REPLAYS.stack else None


class _TiledRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable, sizes: list[int], combine: str, known: tuple, x: torch.Tensor,
                *params: torch.Tensor):
        ctx.fn, ctx.sizes, ctx.combine, ctx.params = fn, sizes, combine, params
        ctx.save_for_backward(x)
        if known:  # the checkpoint's first run computed it (TiledReplay): only the graph is rebuilt here
            return known[0]
        outs = [fn(i, part) for i, part in enumerate(x.split(sizes, dim=1))]
        return torch.cat(outs, dim=1) if combine == "cat" else torch.stack(outs).sum(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        wanted = [p for p in ctx.params if p.requires_grad]
        grad_x = [] if ctx.needs_input_grad[4] else None
        grad_p: list[torch.Tensor | None] = [None] * len(wanted)
        grads = grad.split(ctx.sizes, dim=1) if ctx.combine == "cat" else [grad] * len(ctx.sizes)
        for i, part in enumerate(x.split(ctx.sizes, dim=1)):
            part = part.detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                out = ctx.fn(i, part)
            inputs = ([part] if grad_x is not None else []) + wanted
            got = torch.autograd.grad(out, inputs, grads[i], allow_unused=True)
            if grad_x is not None:
                grad_x.append(got[0])
                got = got[1:]
            grad_p = [g if acc is None else (acc if g is None else acc + g) for acc, g in zip(grad_p, got, strict=True)]
        it = iter(grad_p)
        param_grads = [next(it) if p.requires_grad else None for p in ctx.params]
        return (None, None, None, None, torch.cat(grad_x, dim=1) if grad_x is not None else None, *param_grads)


def tiled_apply(fn: Callable[[int, torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[torch.Tensor], *,
                chunks: int, combine: str = "cat") -> torch.Tensor:
    """Apply ``fn`` to sequence chunks of ``x`` (dim 1), saving only ``x``; recompute in backward.

    Args:
        fn: ``fn(chunk_index, x_chunk) -> tensor``; must be sequence-local (a token's output
            depends only on that token) and deterministic.
        x: ``[B, S, ...]``.
        params: every tensor ``fn`` reads that needs a gradient (a module's parameters).
        chunks: how many chunks.
        combine: ``"cat"`` (outputs along dim 1) or ``"sum"`` (e.g. a loss per chunk).

    Returns:
        The combined output, differentiable in ``x`` and ``params``.
    """
    if combine not in ("cat", "sum"):
        raise ValueError(f"combine={combine!r} must be 'cat' or 'sum'.")
    sizes = chunk_sizes(x.shape[1], chunks)
    replay = active_replay()
    if not torch.is_grad_enabled():
        outs = [fn(i, part) for i, part in enumerate(x.split(sizes, dim=1))]
        out = torch.cat(outs, dim=1) if combine == "cat" else torch.stack(outs).sum(0)
        if replay is not None and not replay.replaying:
            replay.put((tuple(x.shape), x.dtype, combine), out)
        return out
    known = None
    if replay is not None and replay.replaying:
        known = replay.take((tuple(x.shape), x.dtype, combine), x)
    return _TiledRecompute.apply(fn, sizes, combine, () if known is None else (known,), x, *params)


class TiledMLP(nn.Module):
    """Any token-wise module (an MLP) run in sequence chunks, recomputed in backward.

    Args:
        mlp: the module; input ``[B, S, hidden]``.
        chunks: sequence chunks (ALST uses about ``ceil(S / hidden)``).
    """

    def __init__(self, mlp: nn.Module, *, chunks: int) -> None:
        super().__init__()
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"TiledMLP(chunks={chunks!r}) must be a positive int.")
        self.mlp, self.chunks = mlp, chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp(x)``, chunked."""
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        return tiled_apply(lambda _, part: self.mlp(part), x, params, chunks=self.chunks)


def tile_mlp(module: nn.Module, *, chunks: int) -> None:
    """Make ``module``'s own forward tiled in place (parameter names unchanged); :func:`untile_mlp` undoes it.

    Idempotent: tiling again only changes the chunk count.
    """
    cls_forward = type(module).forward

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [p for p in self.parameters() if p.requires_grad]
        return tiled_apply(lambda _, part: cls_forward(self, part, *args, **kwargs), x, params, chunks=chunks)

    module.forward = types.MethodType(forward, module)
    module._plait_tiled_chunks = chunks


def untile_mlp(module: nn.Module) -> None:
    """Undo :func:`tile_mlp` (a no-op on a module that is not tiled)."""
    if "forward" in vars(module) and hasattr(module, "_plait_tiled_chunks"):
        del module.forward
        del module._plait_tiled_chunks


def tile_lm_head(head: nn.Linear, *, chunks: int, ignore_index: int = IGNORE_INDEX) -> None:
    """Let ``head(hidden, labels)`` return the mean cross-entropy without the full logits, in place.

    ``head(hidden)`` still returns the logits. ``head(hidden, labels)`` returns the mean
    cross-entropy of ``head(hidden)`` against ``labels`` over the tokens not ``ignore_index``,
    computed :func:`tiled_apply`-style: the logits exist one sequence chunk at a time
    (``[B, S/chunks, V]``, fp32 for the softmax); forward saves only ``hidden``, and backward
    recomputes each chunk's logits. Unlike :func:`tiled_cross_entropy` (which builds the head's
    ``[V, h]`` fp32 gradient in forward and keeps it until backward), nothing of the head's size is
    kept between forward and backward, and the head's weight is read inside the head's own
    ``__call__``: under ZeRO-3 with offloaded parameters the head is gathered for the loss's
    forward, released, and gathered again for its backward, so the forward's peak is the gathered
    head plus one chunk of logits. Gradients equal the untiled loss's within rounding (the
    head's gradient is summed over chunks). Parameter names are unchanged; idempotent (tiling
    again only changes ``chunks``); :func:`untile_mlp` undoes it.

    Args:
        head: the LM head (``nn.Linear``, bias allowed).
        chunks: sequence chunks of the logits.
        ignore_index: label value that does not count.

    Raises:
        ValueError: ``head`` is not an ``nn.Linear``, or ``chunks`` is not a positive int.
    """
    if not isinstance(head, nn.Linear):
        raise ValueError(f"tile_lm_head(head=...) takes an nn.Linear, got {type(head).__name__}.")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"tile_lm_head(chunks={chunks!r}) must be a positive int.")

    def forward(self: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return F.linear(hidden, self.weight, self.bias)
        if labels.shape != hidden.shape[:2]:
            raise ValueError(f"labels {tuple(labels.shape)} must match hidden states' [B, S] "
                             f"{tuple(hidden.shape[:2])}.")
        label_parts = labels.split(chunk_sizes(hidden.shape[1], chunks), dim=1)

        def chunk_loss(i: int, part: torch.Tensor) -> torch.Tensor:
            logits = F.linear(part, self.weight, self.bias).float()
            return F.cross_entropy(logits.flatten(0, 1), label_parts[i].flatten(), ignore_index=ignore_index,
                                   reduction="sum")

        params = [p for p in (self.weight, self.bias) if p is not None and p.requires_grad]
        total = tiled_apply(chunk_loss, hidden, params, chunks=chunks, combine="sum")
        return total / (labels != ignore_index).sum().clamp_min(1)

    head.forward = types.MethodType(forward, head)
    head._plait_tiled_chunks = chunks


def tiled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunks: int,
                        bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of the cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding all logits.

    Logits exist one sequence chunk at a time (``[B, S/chunks, V]``, in fp32 for the softmax), in
    forward only: each chunk's gradients are computed there (the loss is the last op), and backward
    scales them by its incoming gradient. Call ``backward`` once per forward.

    Args:
        hidden: ``[B, S, h]`` final hidden states.
        weight: the LM head ``[V, h]``.
        labels: ``[B, S]`` targets already aligned with ``hidden`` (shifted), ``ignore_index`` skipped.
        chunks: sequence chunks.
        bias: the LM head's bias, if any.
        ignore_index: label value that contributes nothing.

    Returns:
        The fp32 scalar sum over counted tokens (divide by the token count yourself, e.g. with
        :func:`plait.ulysses_sp.sp_token_count`).
    """
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} must match hidden states' [B, S] {tuple(hidden.shape[:2])}.")
    sizes = chunk_sizes(hidden.shape[1], chunks)
    label_parts = labels.split(sizes, dim=1)

    def chunk_loss(i: int, part: torch.Tensor) -> torch.Tensor:
        logits = F.linear(part, weight, bias).float()
        return F.cross_entropy(logits.flatten(0, 1), label_parts[i].flatten(), ignore_index=ignore_index,
                               reduction="sum")

    wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, sizes, ignore_index, wanted)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias``, chunked, gradients computed in forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, sizes: list[int], ignore_index: int, wanted: bool) -> torch.Tensor:
        grads = _LinearCEGrads(hidden, weight, bias) if wanted else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # One [chunk, V] fp32 buffer for every chunk's logits: a fresh one per chunk costs a page-faulting
        # allocation of the largest tensor of the step each time (on the CPU allocator).
        buffer = torch.empty((hidden.shape[0] * max(sizes), weight.shape[0]), dtype=torch.float32,
                             device=hidden.device)
        start = 0
        for size in sizes:
            part = hidden[:, start:start + size].flatten(0, 1)
            total += _chunk_loss(part, weight, bias, labels[:, start:start + size].flatten(), ignore_index,
                                 grads, start, size, buffer[:part.shape[0]])
            start += size
        ctx.grads = grads
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grads: _LinearCEGrads | None = ctx.grads
        if grads is None:
            raise RuntimeError("tiled_cross_entropy's backward runs once per forward (retain_graph is not supported).")
        ctx.grads = None  # the tensors below are handed over (scaled in place), not copied
        out = grads.scaled(grad)
        return (out[0] if ctx.needs_input_grad[0] else None, out[1] if ctx.needs_input_grad[1] else None,
                out[2] if ctx.needs_input_grad[2] else None, None, None, None, None)


class _LinearCEGrads:
    """The gradients ``tiled_cross_entropy`` builds in forward: hidden states, head weight, bias (fp32 sums)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.hidden = torch.empty_like(hidden)
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        self.bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        self.dtypes = (weight.dtype, None if bias is None else bias.dtype)

    def add(self, dlogits: torch.Tensor, part: torch.Tensor, weight: torch.Tensor, start: int, size: int) -> None:
        """Accumulate one chunk: ``dlogits`` ``[n, V]`` in the model's dtype, ``part`` ``[n, h]``."""
        self.hidden[:, start:start + size] = (dlogits @ weight).view(self.hidden.shape[0], size, -1)
        if dlogits.dtype == torch.float32:
            self.weight.addmm_(dlogits.t(), part)  # no [V, h] temporary per chunk
        else:  # bf16/fp16 head: the product in the model's dtype, as autograd would, summed in fp32
            self.weight += (dlogits.t() @ part).float()
        if self.bias is not None:
            self.bias += dlogits.float().sum(0)

    def scaled(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The three gradients times the loss's incoming gradient, in their parameters' dtypes."""
        bias = None if self.bias is None else self.bias.mul_(grad).to(self.dtypes[1])
        return self.hidden.mul_(grad.to(self.hidden.dtype)), self.weight.mul_(grad).to(self.dtypes[0]), bias


def _chunk_loss(part: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                ignore_index: int, grads: _LinearCEGrads | None, start: int, size: int,
                buffer: torch.Tensor) -> torch.Tensor:
    """One chunk's summed cross-entropy; its gradients go into ``grads`` (softmax - one-hot, in place).

    Every elementwise pass over the ``[n, V]`` logits runs in ``buffer``: log-softmax in place (one
    fused kernel), then ``exp_`` turns it into the softmax that is the gradient.
    """
    if weight.dtype == torch.float32:
        logits = torch.mm(part, weight.t(), out=buffer)
        if bias is not None:
            logits.add_(bias)
    else:  # bf16/fp16 head: the logits in the head's dtype (as autograd computes them), then fp32
        logits = buffer.copy_(F.linear(part, weight, bias))
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    logp = torch.log_softmax(logits, dim=-1, out=logits)
    loss = -(logp.gather(1, target[:, None])[:, 0] * valid).sum()
    if grads is not None:
        dlogits = logp.exp_()  # softmax
        dlogits[torch.arange(len(target), device=target.device), target] -= 1.0
        if not bool(valid.all()):
            dlogits[~valid] = 0.0
        grads.add(dlogits.to(weight.dtype), part, weight, start, size)
    return loss
