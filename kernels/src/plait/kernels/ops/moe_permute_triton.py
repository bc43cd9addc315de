"""Triton kernels of the MoE token permutation: a row gather and an fp32 row scatter-add.

Two kernels serve both ops of :mod:`plait.kernels.ops.moe_permute` and their backwards:

* ``_gather_rows_kernel``: ``out[i] = scale[i] * src[index[i]]`` (scale optional), computed in
  fp32 and stored in ``out``'s dtype. Dispatch forward; combine backward (scaled by the weights).
* ``_scatter_add_rows_kernel``: ``acc[index[i]] += scale[i] * src[i]`` into an fp32 buffer with
  atomics (rows of one token may be in any program). Dispatch backward; combine forward.

Grid: one program per (row, ``BLOCK_H`` columns). Each program moves one contiguous slice of a
row, so loads and stores are coalesced; 1024 columns (4 KiB of fp32) keep a 4-warp program's
registers small while a 4096-wide row needs only four programs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from plait.kernels.dispatch import check_triton_launch_mode

BLOCK_H = 1024


@triton.jit
def _gather_rows_kernel(src_ptr, index_ptr, scale_ptr, out_ptr, H, stride_s, stride_o,  # noqa: N803
                        HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    source = tl.load(index_ptr + row).to(tl.int64)
    vals = tl.load(src_ptr + source * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        vals = vals * tl.load(scale_ptr + row).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, vals.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _scatter_add_rows_kernel(src_ptr, index_ptr, scale_ptr, acc_ptr, H, stride_s, stride_a,  # noqa: N803
                             HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    dest = tl.load(index_ptr + row).to(tl.int64)
    vals = tl.load(src_ptr + row.to(tl.int64) * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        vals = vals * tl.load(scale_ptr + row).to(tl.float32)
    tl.atomic_add(acc_ptr + dest * stride_a + cols, vals, mask=ok)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels step along a row with stride 1."""
    return t if t.stride(-1) == 1 else t.contiguous()


def gather_rows(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``out[i] = scale[i] * src[index[i]]`` (fp32 math, ``out_dtype`` storage)."""
    check_triton_launch_mode(_gather_rows_kernel, src, op="MoE token gather")
    src = _rows_contiguous(src)
    rows, hidden = index.numel(), src.shape[1]
    out = torch.empty(rows, hidden, dtype=out_dtype, device=src.device)
    if rows and hidden:
        scale_arg = scale.to(torch.float32).contiguous() if scale is not None else src
        _gather_rows_kernel[(rows, triton.cdiv(hidden, BLOCK_H))](
            src, index.contiguous(), scale_arg, out, hidden, src.stride(0), out.stride(0),
            HAS_SCALE=scale is not None, BLOCK=BLOCK_H, num_warps=4)
    return out


def scatter_add_rows(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None,
                     num_out: int) -> torch.Tensor:
    """``acc[index[i]] += scale[i] * src[i]`` into a zeroed ``[num_out, H]`` fp32 buffer."""
    check_triton_launch_mode(_scatter_add_rows_kernel, src, op="MoE token scatter-add")
    src = _rows_contiguous(src)
    rows, hidden = src.shape
    acc = torch.zeros(num_out, hidden, dtype=torch.float32, device=src.device)
    if rows and hidden:
        scale_arg = scale.to(torch.float32).contiguous() if scale is not None else src
        _scatter_add_rows_kernel[(rows, triton.cdiv(hidden, BLOCK_H))](
            src, index.contiguous(), scale_arg, acc, hidden, src.stride(0), acc.stride(0),
            HAS_SCALE=scale is not None, BLOCK=BLOCK_H, num_warps=4)
    return acc


class _PermuteTokens(torch.autograd.Function):
    """Dispatch; backward sums each token's gradient rows (fp32, cast to x's dtype)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_index)
        ctx.num_tokens, ctx.dtype = x.shape[0], x.dtype
        return gather_rows(x, token_index, None, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (token_index,) = ctx.saved_tensors
        return scatter_add_rows(grad, token_index, None, ctx.num_tokens).to(ctx.dtype), None


class _CombineRows(torch.autograd.Function):
    """Combine; backward gathers the output gradient to the rows, scaled by their weights."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(rows, token_index, weights)
        return scatter_add_rows(rows, token_index, weights, num_tokens).to(rows.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        rows, token_index, weights = ctx.saved_tensors
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_rows = gather_rows(grad, token_index, weights, rows.dtype)
        if ctx.needs_input_grad[2]:
            per_row = gather_rows(grad, token_index, None, torch.float32)
            grad_weights = (per_row * rows.to(torch.float32)).sum(1).to(weights.dtype)
        return grad_rows, None, grad_weights, None


def permute_tokens_triton(x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """Triton :func:`~plait.kernels.ops.moe_permute.permute_tokens` (inputs validated)."""
    return _PermuteTokens.apply(x, token_index)


def combine_rows_triton(rows: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor,
                        num_tokens: int) -> torch.Tensor:
    """Triton :func:`~plait.kernels.ops.moe_permute.combine_rows` (inputs validated)."""
    return _CombineRows.apply(rows, token_index, weights, num_tokens)
