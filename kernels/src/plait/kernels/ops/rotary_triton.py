"""Triton kernel for rotary embedding: in place on q and k, forward and (as rotation by -theta) backward.

Grid: ``(tokens, cdiv(max(n_q_heads, n_k_heads), BLOCK_H))``. One program takes one token and a
block of ``BLOCK_H`` heads: it loads the token's position, gathers that row's ``rotary_dim/2``
cosines and sines once, and rotates those heads of q and then of k (masked past each tensor's
own head count, which is how GQA/MQA head counts share one grid). Every element is read and
written once; the angle row is read once per program and reused across its heads.

Recomputed: nothing is saved for backward. The derivative of a rotation by ``theta`` is the
rotation by ``-theta``, so the backward runs the same kernel on the incoming gradients with the
sines negated (``INVERSE``); it needs only the positions and the table, which it already holds.

Constants: ``BLOCK_D = next_pow2(rotary_dim/2)`` holds half a head's pairs (rotary_dim <= 1024
is checked before launch, so at most 512 lanes); ``BLOCK_H`` fills the tile up to about 2048
elements per half, so small heads (64) get 64 heads per program and large ones still fit
registers. Pairs are addressed with two offset vectors, ``(i, i + half)`` for the NeoX layout
and ``(2i, 2i + 1)`` for GPT-J, selected at compile time by ``IS_NEOX``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from plait.kernels import dispatch, settings

_TILE = 2048


def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
                   q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, cos_stride, sin_stride,
                   n_q_heads, n_k_heads, half,
                   IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, HAS_K: tl.constexpr,  # noqa: N803
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # noqa: N803
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    cos = tl.load(cos_ptr + pos * cos_stride + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * sin_stride + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if INVERSE:
        sin = -sin
    if IS_NEOX:
        off1 = d
        off2 = d + half
    else:
        off1 = 2 * d
        off2 = 2 * d + 1
    # q heads of this block (the k block below repeats the same six lines on k's pointers; written
    # out twice rather than as a helper so the kernel has no nested jit functions).
    mask = (heads[:, None] < n_q_heads) & dmask[None, :]
    row = q_ptr + tok * q_tok_stride + heads[:, None] * q_head_stride
    x1 = tl.load(row + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(row + off1[None, :], (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(row + off2[None, :], (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    if HAS_K:
        mask = (heads[:, None] < n_k_heads) & dmask[None, :]
        row = k_ptr + tok * k_tok_stride + heads[:, None] * k_head_stride
        x1 = tl.load(row + off1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + off2[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(row + off1[None, :], (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(row + off2[None, :], (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jitted(interpret: bool):
    # triton.jit reads TRITON_INTERPRET when applied; applying it per mode (as rms_norm_triton does)
    # lets one process switch modes and keeps an early import from pinning the wrong one.
    del interpret  # only the cache key
    return triton.jit(_rotary_kernel)


def _launch(q3: torch.Tensor, k3: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            flat: torch.Tensor, rotary_dim: int, is_neox: bool, inverse: bool) -> None:
    """Rotate ``q3``/``k3`` (``[tokens, heads, head_size]``, unit last stride) in place."""
    if not dispatch.triton_device_ok(q3):
        raise ValueError(
            "rotary Triton path needs a CUDA tensor or TRITON_INTERPRET=1; "
            "use PLAIT_KERNEL_BACKEND=auto to fall back to the reference."
        )
    tokens, n_q_heads = q3.shape[0], q3.shape[1]
    n_k_heads = 0 if k3 is None else k3.shape[1]
    if tokens == 0:
        return
    half = rotary_dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_q_heads, n_k_heads)), max(1, _TILE // block_d))
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    k_arg = q3 if k3 is None else k3  # a valid pointer even when HAS_K is off
    grid = (tokens, triton.cdiv(max(n_q_heads, n_k_heads), block_h))
    with _device_guard(q3):
        _jitted(settings.triton_interpret())[grid](
            q3, k_arg, cos, sin, flat.contiguous(),
            q3.stride(0), q3.stride(1), k_arg.stride(0), k_arg.stride(1), cos.stride(0), sin.stride(0),
            n_q_heads, n_k_heads, half,
            IS_NEOX=is_neox, INVERSE=inverse, HAS_K=k3 is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        )


def _device_guard(t: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tensor's device for the launch.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _tokens_view(x4: torch.Tensor) -> torch.Tensor | None:
    """``x4`` as ``[tokens, heads, head_size]`` sharing storage, or None if strides forbid it."""
    if x4.stride(-1) != 1:
        return None
    try:
        return x4.view(-1, x4.shape[-2], x4.shape[-1])
    except RuntimeError:
        return None


def rotary_inplace_triton(q4: torch.Tensor, k4: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          flat: torch.Tensor, rotary_dim: int, is_neox: bool) -> None:
    """Triton path of :func:`plait.kernels.ops.rotary.apply_rotary` (inputs already validated).

    Args:
        q4: ``[..., heads, head_size]`` view of q, rotated in place.
        k4: the same for k, or None.
        cos: ``[max_positions, rotary_dim/2]``.
        sin: ``[max_positions, rotary_dim/2]``.
        flat: int64 positions, one per token.
        rotary_dim: rotated width.
        is_neox: pairing layout.
    """
    views = []
    for x4 in (q4, k4):
        if x4 is None:
            views.append((None, None))
            continue
        x3 = _tokens_view(x4)
        # Strides that cannot be flattened (rare: a permuted batch/seq layout): rotate a compact
        # copy, then write it back, so the caller's tensor is still the one updated.
        views.append((x3, None) if x3 is not None else (x4.reshape(-1, *x4.shape[-2:]).contiguous(), x4))
    (q3, q_back), (k3, k_back) = views
    _launch(q3, k3, cos, sin, flat, rotary_dim, is_neox, inverse=False)
    for compact, original in ((q3, q_back), (k3, k_back)):
        if original is not None:
            original.copy_(compact.view(original.shape))


def rotate_copy(x4: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, flat: torch.Tensor, rotary_dim: int,
                is_neox: bool, *, inverse: bool) -> torch.Tensor:
    """A rotated contiguous copy of ``x4`` (by ``-theta`` with ``inverse``): the Triton path of the
    ``plait::rotary`` custom op (:mod:`plait.kernels.ops.rotary_op`), which rotates q and k apart."""
    out = x4.reshape(-1, *x4.shape[-2:]).clone(memory_format=torch.contiguous_format)
    _launch(out, None, cos, sin, flat, rotary_dim, is_neox, inverse)
    return out.view(x4.shape)


class RotaryFunction(torch.autograd.Function):
    """Out-of-place RoPE: forward rotates copies by ``theta``; backward rotates gradients by ``-theta``."""

    @staticmethod
    def forward(ctx, q4, k4, cos, sin, flat, rotary_dim, is_neox):
        q_out = q4.reshape(-1, *q4.shape[-2:]).clone(memory_format=torch.contiguous_format)
        k_out = None if k4 is None else k4.reshape(-1, *k4.shape[-2:]).clone(memory_format=torch.contiguous_format)
        _launch(q_out, k_out, cos, sin, flat, rotary_dim, is_neox, inverse=False)
        ctx.save_for_backward(cos, sin, flat)
        ctx.meta = (rotary_dim, is_neox, q4.shape, None if k4 is None else k4.shape)
        return q_out.view(q4.shape), (None if k_out is None else k_out.view(k4.shape))

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin, flat = ctx.saved_tensors
        rotary_dim, is_neox, q_shape, k_shape = ctx.meta
        dq = None if grad_q is None else grad_q.reshape(-1, *q_shape[-2:]).clone(memory_format=torch.contiguous_format)
        dk = None
        if grad_k is not None and k_shape is not None:
            dk = grad_k.reshape(-1, *k_shape[-2:]).clone(memory_format=torch.contiguous_format)
        if dq is None:  # only k's output was used: rotate k's gradient alone
            if dk is not None:
                _launch(dk, None, cos, sin, flat, rotary_dim, is_neox, inverse=True)
        else:
            _launch(dq, dk, cos, sin, flat, rotary_dim, is_neox, inverse=True)
        return (None if dq is None else dq.view(q_shape), None if dk is None else dk.view(k_shape),
                None, None, None, None, None)


def rotary_out_of_place_triton(q4: torch.Tensor, k4: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                               flat: torch.Tensor, rotary_dim: int,
                               is_neox: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton path of :func:`plait.kernels.ops.rotary.rotary_embedding` (inputs already validated).

    Returns:
        ``(q_out, k_out)`` shaped like ``q4``/``k4``; differentiable with respect to q and k.
    """
    return RotaryFunction.apply(q4, k4, cos, sin, flat, rotary_dim, is_neox)
