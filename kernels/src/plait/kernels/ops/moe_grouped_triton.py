"""Triton path of the grouped gated-MLP GEMM: forward, backward, and the serving form.

Two kernels:

* ``_grouped_gemm_kernel`` computes ``C[rows of e] = A[rows of e] @ B_e`` for every expert ``e``
  over a block-aligned row order (:func:`plait.kernels.ops.moe_permute.align_tokens_to_blocks`):
  one program per (row tile, column tile), the row tile index the slow axis so programs running
  side by side share one tile of activations and stream neighbouring columns of one expert's
  weights. Every row tile belongs to one expert, read from ``block_experts``; tiles past the
  padded length (the buffers are sized by an upper bound so the launch never syncs) return at
  once. ``B_e`` is addressed by strides, so the same kernel multiplies by ``W_e`` (forward) and by
  ``W_e^T`` (the input gradient). Optional parts, all compile-time: a gated epilogue (two
  accumulators, gate and up halves of ``w_gate_up``, activation-and-multiply before the single
  store, so the ``[N, 2I]`` pre-activation never exists in memory), a row gather
  (``A[sorted_ids // A_ROW_DIV]``: the token permutation fused into the loads) and a per-row scale
  (the router's combine weight, fused into the down GEMM's store).
* ``_grouped_weight_grad_kernel`` computes each expert's weight gradient
  ``dW_e = dY_e^T @ X_e``: one program per (expert, output tile) reducing over the expert's rows.

``precision`` (see :mod:`plait.kernels.ops.moe_grouped`): ``"fp32"`` applies the activation to the
fp32 accumulators; ``"input"`` first rounds gate and up to the input dtype and rounds the
activation before the product, as eager torch does. (Under the interpreter those bf16 casts
truncate where CUDA rounds to nearest even; the bf16 tests' tolerance covers it, and GPU runs
round as eager torch does.)

Backward (:class:`_GroupedGatedMLP`) recomputes ``gate_up`` with one plain grouped GEMM (instead of
keeping ``[N, 2I]`` alive from the forward), takes the activation's local derivative on those rows
with :func:`~plait.kernels.ops.moe_grouped.gate_product_backward` (the ops autograd runs for the
reference's elementwise formula, so both paths share its numerics),
and runs three grouped GEMMs (``d_act``, ``dx``) and two weight-gradient launches.

Tiles: on a GPU the row tile grows with the rows each expert receives (16 for decode, where a
wider tile would only be padding, 32, then 64 for prefill/training); decode takes a long K tile
(128) because its programs are weight-streaming and a 16-row tile leaves shared memory to spare
(16x128 + 2 x 128x64 bf16 = 36 KiB per stage, 4 stages); larger tiles (64x128, K 64, 3 stages)
keep 40 KiB per stage. fp32 halves K and uses 2 stages. When a decode grid would leave SMs idle
the column tile narrows (:func:`fit_columns`). These are reasoned, not tuned: the module was
written without a GPU; retune with ``plait bench inference-kernels`` on one. Under
``TRITON_INTERPRET=1`` the tiles are the smallest ``tl.dot`` accepts (16/32/32) so the CPU
interpreter stays fast, and operands are upcast to fp32 before ``tl.dot`` because the
interpreter's bf16 dot is wrong in Triton 3.x; on a GPU the tensor cores take bf16/fp16 directly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

from plait.kernels.dispatch import check_triton_launch_mode
from plait.kernels.ops.moe_permute import BlockAlignment, align_tokens_to_blocks
from plait.kernels.triton_matmul import mma as _mma

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
    ROUND_GATE: tl.constexpr, MUL_ROUTE_WEIGHT: tl.constexpr,  # noqa: N803
    UPCAST: tl.constexpr, IEEE: tl.constexpr,  # noqa: N803
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
        if ROUND_GATE:
            # Eager numerics: gate, up and the activation each rounded to the storage dtype.
            out_ty = c_ptr.dtype.element_ty
            gate = acc.to(out_ty).to(tl.float32)
            acc = _activation(gate, ACTIVATION).to(out_ty).to(tl.float32) * acc_up.to(out_ty).to(tl.float32)
        else:
            acc = _activation(acc, ACTIVATION) * acc_up
    if MUL_ROUTE_WEIGHT:
        route_w = tl.load(route_w_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * route_w[:, None]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_weight_grad_kernel(
    a_ptr, b_ptr, c_ptr, offsets_ptr, M, N,  # noqa: N803
    stride_ar, stride_am, stride_br, stride_bn, stride_ce, stride_cm, stride_cn,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,  # noqa: N803
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,  # noqa: N803
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    expert = pid // (num_m * num_n)
    tile = pid % (num_m * num_n)
    pid_m = tile // num_n
    pid_n = tile % num_n
    start = tl.load(offsets_ptr + expert)
    count = tl.load(offsets_ptr + expert + 1) - start
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, tl.cdiv(count, BLOCK_R)):
        rows = start + r0 * BLOCK_R + offs_r
        r_ok = offs_r < count - r0 * BLOCK_R
        rows64 = rows.to(tl.int64)
        # A^T tile [BLOCK_M, BLOCK_R] and B tile [BLOCK_R, BLOCK_N] of this expert's rows.
        a = tl.load(a_ptr + rows64[None, :] * stride_ar + offs_m[:, None] * stride_am,
                    mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rows64[:, None] * stride_br + offs_n[None, :] * stride_bn,
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, b, acc, UPCAST, IEEE)
    c_ptrs = c_ptr + expert.to(tl.int64) * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tile sizes and launch options of one grouped-GEMM call."""

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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What every launch of one call shares: the row order, tiles and dtype flags."""

    alignment: BlockAlignment
    tiles: GemmTiles
    upcast: bool
    ieee: bool


def _plan(rows: int, expert_ids: torch.Tensor, num_experts: int, dtype: torch.dtype, interpret: bool) -> _Plan:
    tiles = pick_tiles(rows, num_experts, dtype, interpret=interpret)
    return _Plan(alignment=align_tokens_to_blocks(expert_ids, num_experts, tiles.block_m), tiles=tiles,
                 upcast=interpret and dtype != torch.float32, ieee=dtype == torch.float32)


def _gemm(plan: _Plan, a: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int], c: torch.Tensor, *,
          n_cols: int, k_dim: int, a_row_div: int = 1, gated: bool = False, activation: str = "silu",
          round_gate: bool = False, route_w: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of ``_grouped_gemm_kernel``; ``b_strides`` = (expert, column, k) of ``B``."""
    tiles = fit_columns(plan.tiles, plan.alignment.num_blocks, n_cols, a.device)
    grid = (plan.alignment.num_blocks * triton.cdiv(n_cols, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, route_w if route_w is not None else a,
        plan.alignment.sorted_ids, plan.alignment.block_experts, plan.alignment.num_padded,
        plan.alignment.num_rows, n_cols, k_dim,
        a.stride(0), a.stride(1), *b_strides, c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, ACTIVATION=ACTIVATION_CODES[activation],
        ROUND_GATE=round_gate, MUL_ROUTE_WEIGHT=route_w is not None, UPCAST=plan.upcast, IEEE=plan.ieee,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return c


def _weight_grad(plan: _Plan, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, experts: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``[E, M, N]`` with ``out[e] = a[rows of e]^T @ b[rows of e]`` (zeros for an empty expert)."""
    m_dim, n_dim = a.shape[1], b.shape[1]
    out = torch.empty(experts, m_dim, n_dim, dtype=dtype, device=a.device)
    block_m, block_n, block_r = (16, 32, 32) if plan.upcast or not a.is_cuda else (64, 64, 32)
    grid = (experts * triton.cdiv(m_dim, block_m) * triton.cdiv(n_dim, block_n),)
    _grouped_weight_grad_kernel[grid](
        a, b, out, offsets, m_dim, n_dim, a.stride(0), a.stride(1), b.stride(0), b.stride(1), *out.stride(),
        UPCAST=plan.upcast, IEEE=plan.ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)
    return out


def _gate_product_backward(gate_up: torch.Tensor, d_act: torch.Tensor, activation: str,
                           precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    from plait.kernels.ops.moe_grouped import gate_product_backward

    return gate_product_backward(gate_up, d_act, activation, precision)


def _row_plan(x: torch.Tensor, counts: torch.Tensor, experts: int) -> tuple[_Plan, torch.Tensor]:
    """The launch plan of a call over contiguous segments and its ``[E + 1]`` int64 row offsets."""
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), counts)
    plan = _plan(x.shape[0], expert_of_row.view(-1, 1), experts, x.dtype, interpret=not x.is_cuda)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int64)
    return plan, offsets


def grouped_forward_triton(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                           activation: str, precision: str) -> torch.Tensor:
    """The forward: two grouped GEMMs, the gated activation fused into the first one's epilogue.

    Args and Returns: as :func:`grouped_gated_mlp_triton` (no autograd recorded).
    """
    experts, hidden, inter = w_down.shape
    plan, _ = _row_plan(x, counts, experts)
    act = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    _gemm(plan, x, w_gate_up, (w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2)), act,
          n_cols=inter, k_dim=hidden, gated=True, activation=activation, round_gate=precision == "input")
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype, device=x.device)
    _gemm(plan, act, w_down, (w_down.stride(0), w_down.stride(1), w_down.stride(2)), out,
          n_cols=hidden, k_dim=inter)
    return out


def grouped_backward_triton(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor, activation: str,
                            precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward: ``gate_up`` recomputed, three grouped GEMMs and two weight-gradient reductions.

    Returns:
        ``(d_x, d_w_gate_up, d_w_down)``.
    """
    experts, hidden, inter = w_down.shape
    plan, offsets = _row_plan(x, counts, experts)
    grad = grad.contiguous()
    gate_up = torch.empty(x.shape[0], 2 * inter, dtype=x.dtype, device=x.device)
    _gemm(plan, x, w_gate_up, (w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2)), gate_up,
          n_cols=2 * inter, k_dim=hidden)
    d_act = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    _gemm(plan, grad, w_down, (w_down.stride(0), w_down.stride(2), w_down.stride(1)), d_act,
          n_cols=inter, k_dim=hidden)
    act, d_gate_up = _gate_product_backward(gate_up, d_act, activation, precision)
    d_x = torch.empty_like(x)
    _gemm(plan, d_gate_up, w_gate_up, (w_gate_up.stride(0), w_gate_up.stride(2), w_gate_up.stride(1)), d_x,
          n_cols=hidden, k_dim=2 * inter)
    d_w_gate_up = _weight_grad(plan, d_gate_up, x, offsets, experts, w_gate_up.dtype)
    d_w_down = _weight_grad(plan, grad, act, offsets, experts, w_down.dtype)
    return d_x, d_w_gate_up, d_w_down


class _GroupedGatedMLP(torch.autograd.Function):
    """Eager autograd over :func:`grouped_forward_triton` and :func:`grouped_backward_triton`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                activation: str, precision: str) -> torch.Tensor:
        ctx.save_for_backward(x, counts, w_gate_up, w_down)
        ctx.activation, ctx.precision = activation, precision
        return grouped_forward_triton(x, counts, w_gate_up, w_down, activation, precision)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, None, None]:
        x, counts, w_gate_up, w_down = ctx.saved_tensors
        d_x, d_w_gate_up, d_w_down = grouped_backward_triton(grad, x, counts, w_gate_up, w_down, ctx.activation,
                                                             ctx.precision)
        return d_x, None, d_w_gate_up, d_w_down, None, None


def grouped_gated_mlp_triton(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                             activation: str, precision: str) -> torch.Tensor:
    """Triton :func:`~plait.kernels.ops.moe_grouped.grouped_gated_mlp` (inputs validated)."""
    check_triton_launch_mode(_grouped_gemm_kernel, x, op="grouped gated MLP")
    return _GroupedGatedMLP.apply(x, counts, w_gate_up, w_down, activation, precision)


def routed_experts_triton(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                          precision: str = "fp32") -> torch.Tensor:
    """The serving form, forward only: permutation fused into the GEMMs' loads and stores.

    Rows gather ``hidden[sorted_ids // top_k]`` in the gate/up launch, the down launch scales by
    the routing weight and stores each row at its (token, slot) position, and the ``top_k``
    partial outputs of a token are summed in fp32 (a deterministic reduction over ``[T, k, H]``).

    Args:
        hidden: ``[T, H]``; any strides.
        w_gate_up: ``[E, 2I, H]``; any strides.
        w_down: ``[E, H, I]``; any strides.
        topk_weights: ``[T, top_k]`` combine weights.
        topk_ids: ``[T, top_k]`` expert ids (validated by the caller).
        activation: a key of :data:`ACTIVATION_CODES`.
        precision: ``"fp32"`` (serving) or ``"input"``.

    Returns:
        ``[T, H]`` in ``hidden.dtype``.
    """
    check_triton_launch_mode(_grouped_gemm_kernel, hidden, op="fused MoE")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    num_rows = num_tokens * top_k
    plan = _plan(num_rows, topk_ids, num_experts, hidden.dtype, interpret=not hidden.is_cuda)
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    intermediate = torch.empty(num_rows, inter, dtype=hidden.dtype, device=hidden.device)
    _gemm(plan, hidden, w_gate_up, (w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2)), intermediate,
          n_cols=inter, k_dim=hidden_size, a_row_div=top_k, gated=True, activation=activation,
          round_gate=precision == "input")
    partial = torch.empty(num_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _gemm(plan, intermediate, w_down, (w_down.stride(0), w_down.stride(1), w_down.stride(2)), partial,
          n_cols=hidden_size, k_dim=inter, route_w=route_w)
    if top_k == 1:
        return partial
    return partial.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
