"""Triton blockwise int8 / int4 quantization and dequantization: kernels and launchers.

Grid, recompute and constants - read this before changing anything below.

Both kernels: grid ``(ceil(blocks / ROWS),)``. A program owns ``ROWS`` consecutive quantization
blocks and sees them as a ``[ROWS, BLOCK // 2]`` tile of element pairs: column ``h`` of row ``r``
is elements ``2h`` and ``2h + 1`` of block ``r``. Loading the even and the odd elements as two
tiles lets the int4 path pack a pair into one byte without a reshape, and the int8 path uses the
same tiles so there is one code path for the arithmetic; the two loads touch the same cache
lines, so they cost one pass over memory.

Quantize: each row's absmax is a max-reduction over the row's finite values (fp32); the scale is
``div_rn(absmax, qmax)`` and the codes ``div_rn(x, scale)`` rounded half away from zero.
``div_rn`` (IEEE round-to-nearest division) rather than ``/``, because Triton's ``/`` on fp32 may
lower to an approximate division on GPUs, and the codes must equal the torch reference's bit for
bit (torch divides exactly on CPU and CUDA). Nothing is recomputed: x is read once, codes and one
scale per row are written once.

Dequantize: per row, one scale load and ``code * scale`` in fp32 (a single multiply, so no FMA
contraction can change its rounding), cast once to the output dtype.

Constants:
* ``_TILE_ELEMENTS = 4096``: elements per program, so a program with 256-element blocks handles
  16 blocks and has 16 KiB of fp32 in flight; with ``num_warps = 8`` that is 16 elements per
  thread, enough outstanding loads to stream at bandwidth, few enough registers not to spill.
  Blocks larger than 4096 get one row per program (``ROWS = 1``) and scale num_warps up to 16.
  Untuned: written without a GPU; retune with a benchmark on one.
* Offsets are int64 so tensors above 2^31 elements index correctly.

Triton is imported here and only here, so ``plait.kernels`` imports on machines without Triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from plait.kernels import settings
from plait.kernels.ops.quantize import QMAX, code_dtype, code_numel, num_blocks

_TILE_ELEMENTS = 4096


def _quantize_kernel(
    X, CODES, SCALES,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    N, BLOCKS,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    QMAX_F: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    PACK_INT4: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    ROWS: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    HALF: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    pairs = tl.arange(0, HALF)
    lo_off = rows[:, None] * (2 * HALF) + 2 * pairs[None, :]
    hi_off = lo_off + 1
    lo = tl.load(X + lo_off, mask=lo_off < N, other=0.0).to(tl.float32)
    hi = tl.load(X + hi_off, mask=hi_off < N, other=0.0).to(tl.float32)
    # |v| < inf is False for inf and NaN (padding lanes load 0.0, which is finite).
    lo_ok = tl.abs(lo) < float("inf")
    hi_ok = tl.abs(hi) < float("inf")
    absmax = tl.maximum(
        tl.max(tl.where(lo_ok, tl.abs(lo), 0.0), axis=1), tl.max(tl.where(hi_ok, tl.abs(hi), 0.0), axis=1)
    )
    broken = tl.max(tl.where(lo_ok & hi_ok, 0, 1), axis=1) > 0
    scale = tl.div_rn(absmax, tl.full(absmax.shape, QMAX_F, tl.float32))
    scale = tl.where(broken, float("nan"), scale)
    usable = scale > 0  # False for 0 and NaN: those rows get code 0
    divisor = tl.where(usable, scale, 1.0)[:, None]
    y_lo = tl.where(usable[:, None], tl.div_rn(lo, divisor), 0.0)
    y_hi = tl.where(usable[:, None], tl.div_rn(hi, divisor), 0.0)
    q_lo = tl.minimum(tl.floor(tl.abs(y_lo) + 0.5), QMAX_F)
    q_hi = tl.minimum(tl.floor(tl.abs(y_hi) + 0.5), QMAX_F)
    q_lo = tl.where(y_lo < 0, -q_lo, q_lo).to(tl.int32)
    q_hi = tl.where(y_hi < 0, -q_hi, q_hi).to(tl.int32)
    if PACK_INT4:
        packed = (q_lo & 15) | ((q_hi & 15) << 4)
        byte_off = rows[:, None] * HALF + pairs[None, :]
        tl.store(CODES + byte_off, packed.to(tl.uint8), mask=lo_off < N)
    else:
        tl.store(CODES + lo_off, q_lo.to(tl.int8), mask=lo_off < N)
        tl.store(CODES + hi_off, q_hi.to(tl.int8), mask=hi_off < N)
    tl.store(SCALES + rows, scale, mask=rows < BLOCKS)


def _dequantize_kernel(
    CODES, SCALES, OUT,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    N, BLOCKS,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    PACK_INT4: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    OUT_BF16: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    ROWS: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
    HALF: tl.constexpr,  # noqa: N803 - Triton convention: pointers and constexprs in capitals
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    pairs = tl.arange(0, HALF)
    lo_off = rows[:, None] * (2 * HALF) + 2 * pairs[None, :]
    hi_off = lo_off + 1
    scale = tl.load(SCALES + rows, mask=rows < BLOCKS, other=0.0)[:, None]
    if PACK_INT4:
        byte_off = rows[:, None] * HALF + pairs[None, :]
        packed = tl.load(CODES + byte_off, mask=lo_off < N, other=0).to(tl.int32)
        # Sign-extend each 4-bit two's complement nibble.
        q_lo = ((packed & 15) ^ 8) - 8
        q_hi = (((packed >> 4) & 15) ^ 8) - 8
    else:
        q_lo = tl.load(CODES + lo_off, mask=lo_off < N, other=0).to(tl.int32)
        q_hi = tl.load(CODES + hi_off, mask=hi_off < N, other=0).to(tl.int32)
    out_lo = q_lo.to(tl.float32) * scale
    out_hi = q_hi.to(tl.float32) * scale
    if OUT_BF16:
        # Round to bf16 by hand (nearest, ties to even, NaN kept NaN) so every backend gives torch's
        # bits (the CPU interpreter's own fp32 -> bf16 cast truncates). Adding 0x7FFF plus the lowest
        # kept bit carries into the upper 16 bits exactly when rounding up; the result then has
        # zero low bits, so the final cast below is exact everywhere.
        b_lo = out_lo.to(tl.uint32, bitcast=True)
        b_hi = out_hi.to(tl.uint32, bitcast=True)
        b_lo = ((b_lo + 0x7FFF + ((b_lo >> 16) & 1)) >> 16) << 16
        b_hi = ((b_hi + 0x7FFF + ((b_hi >> 16) & 1)) >> 16) << 16
        out_lo = tl.where(out_lo != out_lo, out_lo, b_lo.to(tl.float32, bitcast=True))
        out_hi = tl.where(out_hi != out_hi, out_hi, b_hi.to(tl.float32, bitcast=True))
    tl.store(OUT + lo_off, out_lo.to(OUT.dtype.element_ty), mask=lo_off < N)
    tl.store(OUT + hi_off, out_hi.to(OUT.dtype.element_ty), mask=hi_off < N)


@functools.cache
def _jitted(interpret: bool) -> tuple:
    # triton.jit picks compiled or interpreted when it is applied, reading TRITON_INTERPRET then;
    # applying it per mode (not at import) keeps a module imported before TRITON_INTERPRET=1 was
    # set from launching GPU code on CPU tensors.
    if interpret and not _stdlib_interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported in compiled mode (triton jits its own "
            "library, e.g. tl.max, at import), so the interpreter cannot run this kernel; set "
            "TRITON_INTERPRET=1 in the environment before the process imports triton."
        )
    return triton.jit(_quantize_kernel), triton.jit(_dequantize_kernel)


def _stdlib_interpreted() -> bool:
    """Whether triton's own jitted library (tl.max) was built for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


def _launch_shape(blocks: int, block_size: int) -> tuple[int, int, int]:
    """``(grid, rows_per_program, num_warps)`` for ``blocks`` blocks of ``block_size``."""
    rows = max(1, min(_TILE_ELEMENTS // block_size, triton.next_power_of_2(blocks)))
    tile = rows * block_size
    num_warps = 8 if tile <= 8192 else 16
    return triton.cdiv(blocks, rows), rows, num_warps


def _device_guard(t: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tensor's device for the launch.
    return torch.cuda.device(t.device) if t.is_cuda else _NullGuard()


class _NullGuard:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def quantize_blockwise_triton(
    x: torch.Tensor, *, bits: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the quantize kernel (arguments already validated by ``quantize.quantize_blockwise``).

    Args:
        x: fp32/bf16/fp16 tensor with at least one element, any shape (copied if not contiguous).
        bits: 8 or 4.
        block_size: power of two >= 2.

    Returns:
        ``(codes, scales)`` in the format of ``quantize.quantize_blockwise``.
    """
    flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().view(-1)
    numel = flat.numel()
    blocks = num_blocks(numel, block_size)
    codes = torch.empty(code_numel(numel, bits), dtype=code_dtype(bits), device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    grid, rows, num_warps = _launch_shape(blocks, block_size)
    with _device_guard(x):
        quantize_kernel, _ = _jitted(settings.triton_interpret())
        quantize_kernel[(grid,)](
            flat, codes, scales, numel, blocks,
            QMAX_F=float(QMAX[bits]), PACK_INT4=bits == 4, ROWS=rows, HALF=block_size // 2,
            num_warps=num_warps,
        )
    return codes, scales


def dequantize_blockwise_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    block_size: int,
    numel: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the dequantize kernel (arguments already validated by ``quantize.dequantize_blockwise``).

    Args:
        codes: int8 or packed uint8 codes.
        scales: fp32 scales.
        bits: 8 or 4.
        block_size: power of two >= 2.
        numel: elements to produce (>= 1).
        dtype: output dtype.
        out: optional contiguous output of ``numel`` elements and ``dtype``.

    Returns:
        ``out``, or a new flat ``[numel]`` tensor of ``dtype``.
    """
    target = out if out is not None else torch.empty(numel, dtype=dtype, device=codes.device)
    flat_codes = codes.reshape(-1) if codes.is_contiguous() else codes.contiguous().view(-1)
    flat_scales = scales.reshape(-1) if scales.is_contiguous() else scales.contiguous().view(-1)
    blocks = num_blocks(numel, block_size)
    grid, rows, num_warps = _launch_shape(blocks, block_size)
    with _device_guard(codes):
        _, dequantize_kernel = _jitted(settings.triton_interpret())
        dequantize_kernel[(grid,)](
            flat_codes, flat_scales, target.view(-1), numel, blocks,
            PACK_INT4=bits == 4, OUT_BF16=dtype == torch.bfloat16, ROWS=rows, HALF=block_size // 2,
            num_warps=num_warps,
        )
    return target
