"""Triton path of the fused MoE: one grouped-GEMM kernel, launched twice.

Grid: one program per (row tile, column tile) of the block-aligned sorted order built by
:func:`plait.inference_kernels.moe.routing.align_tokens_to_blocks`; the row tile index is the slow
axis so that the programs running side by side share one tile of activations and stream
neighbouring columns of one expert's weights. Every row tile belongs to one expert, read from
``block_experts``; tiles past the padded length (the buffers are sized by an upper bound so the
launch never syncs) return at once.

Launch 1 (gate/up): rows gather ``hidden[row // top_k]`` and multiply by the expert's gate and up
halves of ``w_gate_up`` with two accumulators, and the activation-and-multiply is applied on the
fp32 accumulators before the single store, so the ``[T*k, 2I]`` pre-activation never exists in
memory. Launch 2 (down): rows read the intermediate, multiply by ``w_down`` and scale by the
routing weight. The ``top_k`` partial outputs of a token are then summed in fp32 (a reduction
over a ``[T, k, H]`` view, which is deterministic, unlike atomics).

Constants: on a GPU the row tile grows with the tokens each expert receives (16 for decode,
where a wider tile would only be padding, 32, then 64 for prefill); decode takes a long K tile
(128) because its programs are weight-streaming and a 16-row tile leaves shared memory to spare
(16x128 + 2 x 128x64 bf16 = 36 KiB per stage, 4 stages); prefill tiles (64x128, K 64, 3 stages)
keep 40 KiB per stage. fp32 halves K and uses 2 stages. When a decode grid would leave SMs idle
the column tile narrows (:func:`fit_columns`). These are reasoned, not tuned: the module was
written without a GPU; retune with ``plait bench inference-kernels`` on one. Under ``TRITON_INTERPRET=1`` the
tiles are the smallest ``tl.dot`` accepts (16/32/32) so the CPU interpreter stays fast, and the
operands are upcast to fp32 before ``tl.dot`` because the interpreter's bf16 dot is wrong in
Triton 3.x (checked against torch); on a GPU the tensor cores take bf16/fp16 directly.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from plait.inference_kernels.moe.routing import align_tokens_to_blocks
from plait.inference_kernels.triton_matmul import mma as _mma
from plait.kernels.dispatch import check_triton_launch_mode

ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):  # noqa: N803
    if ACTIVATION == 0:
        return x * tl.sigmoid(x)
    elif ACTIVATION == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        # tanh(y) = 2 * sigmoid(2y) - 1; tl has no tanh on every backend.
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (2.0 * tl.sigmoid(2.0 * inner))


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, route_w_ptr,
    sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_rows, N, K,  # noqa: N803
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,  # noqa: N803
    MUL_ROUTE_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,  # noqa: N803
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rows < num_rows
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, b, acc, UPCAST, IEEE)
        if GATED:
            # The up half of w_gate_up starts N rows below the gate half.
            up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = _mma(a, up, acc_up, UPCAST, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = _activation(acc, ACTIVATION) * acc_up
    if MUL_ROUTE_WEIGHT:
        route_w = tl.load(route_w_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * route_w[:, None]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tile sizes and launch options of one fused-MoE call."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_tiles(num_rows: int, num_experts: int, dtype: torch.dtype, *, interpret: bool) -> GemmTiles:
    """Choose tiles from the average rows per expert (see the module comment for why).

    fp32 operands take twice the shared memory per tile, so they get a shorter K tile and a
    2-stage pipeline to stay inside the 228 KiB of an H100 SM.
    """
    if interpret:
        return GemmTiles(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    rows_per_expert = num_rows / max(num_experts, 1)
    if rows_per_expert <= 16:
        tiles = GemmTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif rows_per_expert <= 64:
        tiles = GemmTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    else:
        tiles = GemmTiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        tiles = dataclasses.replace(tiles, block_k=min(tiles.block_k, 32), num_stages=2)
    return tiles


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fit_columns(tiles: GemmTiles, row_blocks: int, n_cols: int, device: torch.device) -> GemmTiles:
    """Narrow the column tile (down to 32) while the grid would leave SMs idle.

    A decode step has one or two row tiles per expert, so the down GEMM (N = H) can launch fewer
    programs than the GPU has SMs; narrower column tiles give more programs, each streaming its
    own slice of the weights, which is what a weight-bandwidth-bound GEMM needs.
    """
    if device.type != "cuda":
        return tiles
    block_n, target = tiles.block_n, 2 * _sm_count(device.index if device.index is not None else 0)
    while block_n > 32 and row_blocks * triton.cdiv(n_cols, block_n) < target:
        block_n //= 2
    return dataclasses.replace(tiles, block_n=block_n)


def _launch(a, b, c, route_w, alignment, *, n_cols, k_dim, a_row_div, gated, activation,
            mul_route_weight, tiles, interpret):
    tiles = fit_columns(tiles, alignment.num_blocks, n_cols, a.device)
    grid = (alignment.num_blocks * triton.cdiv(n_cols, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, route_w,
        alignment.sorted_ids, alignment.block_experts, alignment.num_padded,
        alignment.num_rows, n_cols, k_dim,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, ACTIVATION=ACTIVATION_CODES[activation],
        MUL_ROUTE_WEIGHT=mul_route_weight,
        UPCAST=interpret and a.dtype != torch.float32,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def fused_experts_triton(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Launch the two grouped GEMMs and the fp32 combine (inputs already validated).

    Args:
        hidden: ``[T, H]``; any strides.
        w_gate_up: ``[E, 2I, H]``; any strides.
        w_down: ``[E, H, I]``; any strides.
        topk_weights: ``[T, top_k]`` combine weights.
        topk_ids: ``[T, top_k]`` expert ids.
        activation: a key of :data:`ACTIVATION_CODES`.

    Returns:
        ``[T, H]`` in ``hidden.dtype``.
    """
    check_triton_launch_mode(_grouped_gemm_kernel, hidden, op="fused MoE")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    interpret = not hidden.is_cuda
    tiles = pick_tiles(num_rows, num_experts, hidden.dtype, interpret=interpret)
    alignment = align_tokens_to_blocks(topk_ids, num_experts, tiles.block_m)
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()

    intermediate = torch.empty(num_rows, inter, dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w_gate_up, intermediate, route_w, alignment, n_cols=inter, k_dim=hidden_size,
            a_row_div=top_k, gated=True, activation=activation, mul_route_weight=False,
            tiles=tiles, interpret=interpret)
    partial = torch.empty(num_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _launch(intermediate, w_down, partial, route_w, alignment, n_cols=hidden_size, k_dim=inter,
            a_row_div=1, gated=False, activation=activation, mul_route_weight=True,
            tiles=tiles, interpret=interpret)
    if top_k == 1:
        return partial
    return partial.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


