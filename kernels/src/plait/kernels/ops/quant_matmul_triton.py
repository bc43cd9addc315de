"""Triton weight-only quantized matmul: ``y = x @ dequantize(W)^T (+ bias)`` in one kernel.

Grid ``(ceil(M / BLOCK_M), ceil(N / BLOCK_N))``. A program owns a ``BLOCK_M x BLOCK_N`` tile of
the output and walks K in steps of ``BLOCK_K``: it loads the x tile, loads the weight's codes for
its ``BLOCK_N`` rows (int8 bytes, int4 nibbles, or fp6's three bytes per four codes), dequantizes
them in registers with their scales (and int4 zero points), and accumulates ``tl.dot`` in fp32.
The weight never exists dequantized in memory: only its codes and scales are read, which is the
point on memory-bound decode.

Numerics: x and the dequantized weight are both fp32 in the dot with ``input_precision="ieee"``
(no tf32), so the kernel matches :func:`plait.kernels.ops.quant_matmul.quant_matmul_reference` up
to fp32 summation order; the fp32 output is cast to x's dtype by torch after the launch (one
rounding, the reference's). ``BLOCK_K`` divides the int4 group size, so a K step never straddles
two groups' scales. (Block sizes are untuned: this module was written without a GPU.)

CPU interpreter (``TRITON_INTERPRET=1``): how the tests run the kernel without a GPU; it must be set
before the process imports triton (``check_triton_launch_mode`` says so otherwise).

Triton is imported here and only here, so ``plait.kernels`` imports on machines without Triton.
"""

# ruff: noqa: N803 - Triton convention: pointers and constexpr arguments are capitalised.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.kernels.dispatch import check_triton_launch_mode

_KIND_CODE = {"int8": 0, "int4": 1, "fp6": 2}
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _dequant_tile(C, S, Z, rn, rk, N, K, stride_c, stride_s, GROUP: tl.constexpr,
                  KIND: tl.constexpr, HAS_ZERO: tl.constexpr):
    # Returns the fp32 [BLOCK_K, BLOCK_N] tile of W^T for rows rn and columns rk.
    mask = (rn[None, :] < N) & (rk[:, None] < K)
    row = rn[None, :].to(tl.int64) * stride_c
    if KIND == 0:
        q = tl.load(C + row + rk[:, None], mask=mask, other=0).to(tl.float32)
        s = tl.load(S + rn, mask=rn < N, other=0.0)
        w = q * s[None, :]
    elif KIND == 1:
        byte = tl.load(C + row + rk[:, None] // 2, mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((rk[:, None] % 2) * 4)) & 15).to(tl.float32)
        grp = rk[:, None] // GROUP
        soff = rn[None, :].to(tl.int64) * stride_s + grp
        s = tl.load(S + soff, mask=mask, other=0.0)
        if HAS_ZERO:
            z = tl.load(Z + soff, mask=mask, other=0).to(tl.float32)
        else:
            z = 8.0
        w = (q - z) * s
    else:
        base = row + (rk[:, None] // 4) * 3
        b0 = tl.load(C + base, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(C + base + 1, mask=mask, other=0).to(tl.int32)
        b2 = tl.load(C + base + 2, mask=mask, other=0).to(tl.int32)
        word = b0 | (b1 << 8) | (b2 << 16)
        code = (word >> ((rk[:, None] % 4) * 6)) & 63
        e = (code >> 2) & 7
        m = (code & 3).to(tl.float32)
        # e3m2 with bias 3: subnormal m/4 * 2^-2, normal (1 + m/4) * 2^(e-3) = (4 + m) * 2^(e-5).
        mag = tl.where(e == 0, m * 0.0625, (4.0 + m) * tl.exp2((e - 5).to(tl.float32)))
        val = tl.where((code & 32) != 0, -mag, mag)
        s = tl.load(S + rn, mask=rn < N, other=0.0)
        w = val * s[None, :]
    return w


@triton.jit
def _quant_matmul_kernel(X, C, S, Z, B, Y, M, N, K, stride_xm, stride_c, stride_s, stride_ym,
                         GROUP: tl.constexpr, KIND: tl.constexpr, HAS_ZERO: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0).to(tl.float32)
        w = _dequant_tile(C, S, Z, rn, rk, N, K, stride_c, stride_s, GROUP, KIND, HAS_ZERO)
        acc += tl.dot(x, w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def quant_matmul_triton(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    kind: str, group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernel on validated inputs (see :func:`plait.kernels.ops.quant_matmul.quant_matmul`).

    Args:
        x: ``[..., K]`` input.
        codes, scales, zeros: the quantized weight (contiguous), as ``quantize_weight`` returns them.
        kind: ``"int8"``, ``"int4"`` or ``"fp6"``.
        group_size: the int4 group size (ignored otherwise).
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in x's dtype.
    """
    check_triton_launch_mode(_quant_matmul_kernel, x, op="quant_matmul")
    k = x.shape[-1]
    n = codes.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    codes = codes.contiguous()
    scales = scales.to(torch.float32).contiguous()
    zero_arg = zeros.contiguous() if zeros is not None else scales
    bias_arg = bias.contiguous() if bias is not None else scales
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _quant_matmul_kernel[grid](
        x2, codes, scales, zero_arg, bias_arg, y, m, n, k,
        x2.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
        GROUP=group_size if kind == "int4" else 1, KIND=_KIND_CODE[kind], HAS_ZERO=zeros is not None,
        HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
