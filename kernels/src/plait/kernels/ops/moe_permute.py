"""Mixture-of-Experts token permutation: sort assignments by expert, move rows there and back.

A MoE layer hands each (token, slot) assignment to one expert. Before the experts' grouped GEMM
(:mod:`plait.kernels.ops.moe_grouped`) the assignments are sorted by expert so each expert's rows
form one contiguous segment; after it, every output row goes back to its token, weighted by the
router's combine weight. The same steps serve training (plait-moe-layers) and serving
(plait-inference-kernels):

* :func:`permute_by_expert`: the stable sort of the expert ids and each expert's row count;
* :func:`align_tokens_to_blocks`: the same sort, with every expert's run padded to the grouped
  GEMM's row tile and written with torch ops that never read a value back to the host (the form
  the Triton GEMM takes; vLLM calls this ``moe_align_block_size``);
* :func:`permute_tokens`: ``rows = x[token_index]`` (dispatch), differentiable; its backward
  sums the gradient rows of each token (a scatter-add);
* :func:`combine_rows`: ``out[t] = sum_{i: token_index[i] = t} weights[i] * rows[i]`` in fp32,
  cast to the rows' dtype once (combine); its backward gathers the output gradient back to the
  rows and gives the weights their gradient.

Both data-moving ops run the Triton kernels of :mod:`plait.kernels.ops.moe_permute_triton`
(forward and backward) on CUDA and the torch reference elsewhere (``PLAIT_KERNEL_BACKEND``
forces one). The Triton scatter-add accumulates in fp32 with atomics: a token's rows add up in
an unspecified order, which is bitwise deterministic for up to two rows per token (fp32 addition
commutes) and within fp32 rounding beyond; the reference is deterministic.
"""

from __future__ import annotations

import dataclasses

import torch

from plait.kernels import dispatch


def permute_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order assignments by expert and count each expert's rows.

    Args:
        expert_ids: ``[N]`` integer expert id of each assignment, in ``[0, num_experts)``.
        num_experts: the number of experts (segments), so empty experts get a count of 0.

    Returns:
        ``(order, counts)``: ``order`` ``[N]`` int64 such that ``expert_ids[order]`` is sorted
        (stable), and ``counts`` ``[num_experts]`` int64 rows per expert.

    Raises:
        ValueError: ``expert_ids`` is not a 1-D integer tensor or ``num_experts < 1``.
    """
    if expert_ids.dim() != 1 or expert_ids.is_floating_point() or expert_ids.is_complex():
        raise ValueError(f"expert_ids must be a 1-D integer tensor, got {expert_ids.dtype} {tuple(expert_ids.shape)}.")
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1.")
    ids = expert_ids.to(torch.int64)
    order = torch.argsort(ids, stable=True)
    # index_add_ instead of bincount: bincount sizes its output from the data (a data-dependent
    # shape under torch.compile, a host sync on CUDA).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    return order, counts


@dataclasses.dataclass(frozen=True)
class BlockAlignment:
    """The sorted, block-padded row order of a grouped expert GEMM.

    Attributes:
        sorted_ids: ``[num_blocks * block_m]`` int32; entry ``i`` is the flat (token, slot) index
            ``t * top_k + j`` processed at sorted row ``i``, or ``num_rows`` for a padding row.
        block_experts: ``[num_blocks]`` int32, the expert of each row tile (tiles past the
            padded length repeat the last expert and are skipped by the kernel).
        num_padded: ``[1]`` int32 on the device, the true padded length (a multiple of block_m).
        num_rows: ``T * top_k``.
        block_m: the row-tile size the padding was made for.
    """

    sorted_ids: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    num_rows: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        """Row tiles in the buffers (an upper bound on the tiles holding real rows)."""
        return self.block_experts.numel()


def max_aligned_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on row tiles after padding: each expert that gets rows wastes < one tile.

    At most ``min(num_experts, num_rows)`` experts receive rows, and each pads by at most
    ``block_m - 1``; the bound is what lets the buffers be sized without reading counts back.
    """
    padded = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-padded // block_m)


def align_tokens_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Sort (token, slot) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Args:
        topk_ids: ``[T, top_k]`` int32/int64 expert ids in ``[0, num_experts)`` (rows already
            sorted by expert, given as ``[N, 1]``, come out in their own order).
        num_experts: E.
        block_m: the grouped GEMM's row tile (a power of two).

    Returns:
        The :class:`BlockAlignment`; rows of one expert keep their original order (stable sort),
        which keeps the kernel's reads of the hidden states as sequential as the routing allows.

    Raises:
        ValueError: ``topk_ids`` is not a 2-D int32/int64 tensor, or ``block_m < 1``.
    """
    if (not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2
            or topk_ids.dtype not in (torch.int32, torch.int64)):
        got = f"{topk_ids.dtype} {tuple(topk_ids.shape)}" if isinstance(topk_ids, torch.Tensor) else type(topk_ids)
        raise ValueError(f"topk_ids must be a 2-D torch.int32 or torch.int64 tensor [T, top_k], got {got}.")
    if block_m < 1:
        raise ValueError(f"block_m={block_m} must be >= 1.")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    # index_add_ instead of bincount: bincount sizes its output from the data (a host sync on CUDA).
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, dim=0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, dim=0) - counts

    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_rows, device=device) - count_start[sorted_experts]
    destination = padded_start[sorted_experts] + rank_in_expert

    num_blocks = max_aligned_blocks(num_rows, num_experts, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_ids[destination] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return BlockAlignment(
        sorted_ids=sorted_ids,
        block_experts=block_experts.to(torch.int32),
        num_padded=padded_end[-1:].to(torch.int32),
        num_rows=num_rows,
        block_m=block_m,
    )


def _check_rows(name: str, x: torch.Tensor, token_index: torch.Tensor) -> None:
    """Refuse a non-float ``[*, H]`` tensor or a non-integer 1-D index before any work."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a 2-D floating-point tensor [rows, H].")
    if (not isinstance(token_index, torch.Tensor) or token_index.dim() != 1
            or token_index.is_floating_point() or token_index.is_complex()):
        raise ValueError("token_index must be a 1-D integer tensor (the token of each row).")
    if token_index.device != x.device:
        raise ValueError(f"token_index is on {token_index.device} but {name} is on {x.device}; move it there.")


def permute_tokens_reference(x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """``x[token_index]`` in torch (the CPU path and oracle; autograd gives the backward)."""
    return x.index_select(0, token_index.to(torch.int64))


def permute_tokens(x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """Dispatch: row ``i`` of the result is ``x[token_index[i]]``.

    Args:
        x: ``[T, H]`` token states, fp32/bf16/fp16 (fp64 takes the reference).
        token_index: ``[N]`` int32/int64 token of each row, in ``[0, T)`` (a token may appear
            several times, once per kept slot, or not at all).

    Returns:
        ``[N, H]`` in ``x.dtype``; differentiable in ``x`` (the backward adds each token's
        gradient rows, in fp32 on the Triton path).

    Raises:
        ValueError: ``x`` is not a 2-D float tensor, or ``token_index`` not a 1-D integer tensor
            on ``x``'s device.
    """
    _check_rows("x", x, token_index)
    use_triton = dispatch.select_backend(x) == dispatch.TRITON and x.dtype != torch.float64
    if not _eager_autograd(x):
        return torch.ops.plait.permute_tokens(x, token_index, use_triton)
    if use_triton:
        from plait.kernels.ops import moe_permute_triton

        return moe_permute_triton.permute_tokens_triton(x, token_index)
    return permute_tokens_reference(x, token_index)


def combine_rows_reference(rows: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor,
                           num_tokens: int) -> torch.Tensor:
    """The combine in torch: weighted rows summed per token in fp32, cast once (the CPU path)."""
    out = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    scaled = rows.to(torch.float32) * weights.to(torch.float32)[:, None]
    return out.index_add(0, token_index.to(torch.int64), scaled).to(rows.dtype)


def combine_rows(rows: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """Combine: ``out[t] = sum_{i: token_index[i] = t} weights[i] * rows[i]``, in fp32.

    Args:
        rows: ``[N, H]`` expert outputs, fp32/bf16/fp16 (fp64 takes the reference).
        token_index: ``[N]`` int32/int64 token of each row, in ``[0, num_tokens)``.
        weights: ``[N]`` combine weight of each row (any float dtype; used in fp32).
        num_tokens: ``T``, the output's rows (tokens without rows get zeros).

    Returns:
        ``[T, H]`` in ``rows.dtype``; differentiable in ``rows`` and ``weights``.

    Raises:
        ValueError: bad ranks or dtypes, ``weights`` not ``[N]``, or tensors on other devices.
    """
    _check_rows("rows", rows, token_index)
    if (not isinstance(weights, torch.Tensor) or not weights.is_floating_point()
            or tuple(weights.shape) != (rows.shape[0],) or token_index.shape[0] != rows.shape[0]):
        raise ValueError(f"weights and token_index must be [N={rows.shape[0]}] (one per row of rows); got "
                         f"{tuple(getattr(weights, 'shape', ()))} and {tuple(token_index.shape)}.")
    use_triton = dispatch.select_backend(rows) == dispatch.TRITON and rows.dtype != torch.float64
    if not _eager_autograd(rows, weights):
        return torch.ops.plait.combine_rows(rows, token_index, weights, num_tokens, use_triton)
    if use_triton:
        from plait.kernels.ops import moe_permute_triton

        return moe_permute_triton.combine_rows_triton(rows, token_index, weights, num_tokens)
    return combine_rows_reference(rows, token_index, weights, num_tokens)


# The custom ops: opaque to torch.compile, shape-only fakes, and registered backwards that run the
# steps autograd runs for the references (CPU) or the Triton kernels' backward.


def _eager_autograd(*tensors: torch.Tensor) -> bool:
    """Eager with gradients: the autograd Functions (Triton) or autograd of the reference run, so the
    recorded graph stays what it was; under torch.compile and without gradients the custom ops run."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and not torch.compiler.is_compiling())


@torch.library.custom_op("plait::permute_tokens", mutates_args=())
def _permute_op(x: torch.Tensor, token_index: torch.Tensor, use_triton: bool) -> torch.Tensor:
    if use_triton:
        from plait.kernels.ops.moe_permute_triton import gather_rows

        return gather_rows(x, token_index, None, x.dtype)
    return permute_tokens_reference(x, token_index)


@_permute_op.register_fake
def _permute_fake(x, token_index, use_triton):
    return x.new_empty(token_index.shape[0], x.shape[1])


@torch.library.custom_op("plait::permute_tokens_backward", mutates_args=())
def _permute_backward_op(grad: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                         use_triton: bool) -> torch.Tensor:
    if use_triton:
        from plait.kernels.ops.moe_permute_triton import scatter_add_rows

        return scatter_add_rows(grad, token_index, None, num_tokens).to(grad.dtype)
    # index_select's backward as autograd runs it: zeros, then index_add_.
    return grad.new_zeros(num_tokens, grad.shape[1]).index_add_(0, token_index.to(torch.int64), grad)


@_permute_backward_op.register_fake
def _permute_backward_fake(grad, token_index, num_tokens, use_triton):
    return grad.new_empty(num_tokens, grad.shape[1])


def _permute_setup(ctx, inputs, output) -> None:
    x, token_index, use_triton = inputs
    ctx.save_for_backward(token_index)
    ctx.num_tokens, ctx.use_triton = x.shape[0], use_triton


def _permute_backward(ctx, grad):
    (token_index,) = ctx.saved_tensors
    return torch.ops.plait.permute_tokens_backward(grad, token_index, ctx.num_tokens, ctx.use_triton), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("plait::combine_rows", mutates_args=())
def _combine_op(rows: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor, num_tokens: int,
                use_triton: bool) -> torch.Tensor:
    if use_triton:
        from plait.kernels.ops.moe_permute_triton import scatter_add_rows

        return scatter_add_rows(rows, token_index, weights, num_tokens).to(rows.dtype)
    return combine_rows_reference(rows, token_index, weights, num_tokens)


@_combine_op.register_fake
def _combine_fake(rows, token_index, weights, num_tokens, use_triton):
    return rows.new_empty(num_tokens, rows.shape[1])


@torch.library.custom_op("plait::combine_rows_backward", mutates_args=())
def _combine_backward_op(grad: torch.Tensor, rows: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor,
                         use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton:
        from plait.kernels.ops.moe_permute_triton import gather_rows

        per_row = gather_rows(grad, token_index, None, torch.float32)
        grad_rows = gather_rows(grad, token_index, weights, rows.dtype)
    else:  # autograd's steps for combine_rows_reference: cast, index_add's gather, the products' grads
        per_row = grad.to(torch.float32).index_select(0, token_index.to(torch.int64))
        grad_rows = (per_row * weights.to(torch.float32)[:, None]).to(rows.dtype)
    return grad_rows, (per_row * rows.to(torch.float32)).sum(1).to(weights.dtype)


@_combine_backward_op.register_fake
def _combine_backward_fake(grad, rows, token_index, weights, use_triton):
    return torch.empty_like(rows), torch.empty_like(weights)


def _combine_setup(ctx, inputs, output) -> None:
    rows, token_index, weights, _, use_triton = inputs
    ctx.save_for_backward(rows, token_index, weights)
    ctx.use_triton = use_triton


def _combine_backward(ctx, grad):
    rows, token_index, weights = ctx.saved_tensors
    grad_rows, grad_weights = torch.ops.plait.combine_rows_backward(grad, rows, token_index, weights, ctx.use_triton)
    return grad_rows, None, grad_weights, None, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)
