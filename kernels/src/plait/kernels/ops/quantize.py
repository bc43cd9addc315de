"""Blockwise symmetric int8 / int4 quantization for communication: public functions and reference.

ZeRO++ (plait.zero_sharding.zeropp) sends weights and gradients as small integer codes plus one
fp32 scale per block of ``block_size`` consecutive elements. This module is the op (the op
pattern of docs/conventions.md): validate, pick a backend with
:func:`plait.kernels.dispatch.select_backend`, and run either the Triton kernels
(``quantize_triton``, imported only when chosen) or the pure-torch reference below, which is both
the CPU path and the oracle the tests compare the kernels against (bit for bit: same codes,
same scales, same dequantized values).

Format (both paths):

* The input is read as a flat vector of ``numel`` elements, cut into ``ceil(numel / block_size)``
  blocks; the last block may be partial.
* ``scale = absmax(block) / qmax`` in fp32, with ``qmax = 127`` for 8 bits and ``7`` for 4 bits
  (symmetric: -8 is never used, so 0 is exact and the range is the same on both sides).
* ``code = sign(y) * min(floor(|y| + 0.5), qmax)`` with ``y = x / scale`` (IEEE fp32 division,
  rounding half away from zero), so ``|x - code * scale| <= scale / 2`` up to fp32 rounding: the
  division (relative 2^-24 of the scale) and the product ``code * scale`` (2^-24 of |x|; an exact
  half, e.g. a bf16 input with ``x / scale = 63.5``, reaches scale / 2 before that last rounding).
* 8 bits: codes are ``int8``, one per element (``numel`` bytes). 4 bits: codes are packed two per
  ``uint8`` byte, element ``2i`` in the low nibble and ``2i + 1`` in the high nibble, each as a
  4-bit two's complement value; an odd ``numel`` leaves the last high nibble 0
  (``ceil(numel / 2)`` bytes). ``block_size`` is a power of two >= 2, so a block never splits a byte.
* An all-zero block has scale 0 and codes 0 (dequantizes to exact zeros).
* A block holding any inf or NaN gets scale NaN and codes 0, so the whole dequantized block is
  NaN: the corruption stays visible after communication (an overflow check after the gradient
  reduction still sees it) instead of turning into large finite values.
* A block whose absmax is below ``qmax`` times the smallest fp32 subnormal has scale 0 (the
  division underflows) and dequantizes to zeros; its error is that absmax, under 1e-42.

No autograd: these ops move tensors through collectives (weights after the optimizer step,
gradients after backward) and are never part of a differentiated graph, so no
``torch.autograd.Function`` wraps them; the codes are integers and have no gradient anyway.
"""

from __future__ import annotations

import math

import torch

from plait.kernels import dispatch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_BITS = (4, 8)
MAX_BLOCK_SIZE = 65536
QMAX = {8: 127, 4: 7}


def num_blocks(numel: int, block_size: int) -> int:
    """Number of quantization blocks (and fp32 scales) for ``numel`` elements."""
    return -(-numel // block_size)


def code_numel(numel: int, bits: int) -> int:
    """Number of code elements (int8 values, or packed uint8 bytes for 4 bits) for ``numel`` elements."""
    return numel if bits == 8 else -(-numel // 2)


def code_dtype(bits: int) -> torch.dtype:
    """The dtype of the codes: ``int8`` for 8 bits, ``uint8`` (two codes a byte) for 4 bits."""
    return torch.int8 if bits == 8 else torch.uint8


def quantized_nbytes(numel: int, *, bits: int, block_size: int) -> int:
    """Bytes of codes plus fp32 scales for ``numel`` elements: what one quantized copy costs."""
    return code_numel(numel, bits) + 4 * num_blocks(numel, block_size)


def _check_format(bits: object, block_size: object, fn: str) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{fn}: bits={bits!r} is not supported; pass bits=8 (int8) or bits=4 (packed int4).")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 2
        or block_size > MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"{fn}: block_size={block_size!r} must be a power of two in [2, {MAX_BLOCK_SIZE}]; pass e.g. 256."
        )


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def quantize_blockwise_reference(
    x: torch.Tensor, *, bits: int = 8, block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch blockwise quantization: the CPU path and the test oracle (no validation).

    Args:
        x: tensor of any shape (read flat, in fp32).
        bits: 8 or 4.
        block_size: elements per scale, a power of two.

    Returns:
        ``(codes, scales)``: codes ``int8 [numel]`` (8 bits) or ``uint8 [ceil(numel/2)]`` (4 bits),
        scales ``float32 [ceil(numel/block_size)]``, on x's device.
    """
    numel = x.numel()
    qmax = float(QMAX[bits])
    blocks = num_blocks(numel, block_size)
    flat = x.reshape(-1).to(torch.float32)
    # Codes of every block, the partial last one padded; an odd count's pad code (0) is then the
    # high nibble int4 leaves 0, with no copy.
    codes = torch.empty(blocks * block_size, dtype=torch.int8, device=x.device)
    scales = _quantize_chunks(flat, block_size, qmax, codes.view(blocks, block_size))
    if bits == 8:
        return codes[:numel], scales
    pairs = codes[:numel + numel % 2].view(-1, 2)
    # int8 shifts wrap like the uint8 ones (torch shifts signed values as unsigned): the high
    # nibble's sign bits fall off the byte, the low nibble keeps its 4 bits.
    return ((pairs[:, 1] << 4) | (pairs[:, 0] & 15)).view(torch.uint8), scales


# Elements per chunk of the quantize reference's fp32 temporaries (1 MiB each): they stay in the
# L2 cache across the passes and are reused, where whole-size temporaries of a multi-MB bucket were
# fresh allocations the allocator often returned to the OS, so each pass page-faulted (measured on
# 2.1M fp32 elements: 17 ms whole vs 2.7 ms chunked, int4, one thread). Large enough that a
# ZeRO++ shard (~0.2-0.5M elements) is one chunk: each chunk costs about a dozen op launches.
CHUNK_ELEMENTS = 1 << 18


def _chunks(flat: torch.Tensor, block_size: int) -> list[tuple[int, int, torch.Tensor]]:
    """``(first block, end block, [blocks, block_size] fp32 source)`` per chunk of ``flat``: views of
    the input, except a last chunk holding the partial block, copied and padded with zeros (they
    change no block's absmax)."""
    numel = flat.numel()
    blocks = num_blocks(numel, block_size)
    rows = max(1, CHUNK_ELEMENTS // block_size)
    out = []
    for start in range(0, blocks, rows):
        stop = min(blocks, start + rows)
        source = flat[start * block_size:stop * block_size]
        if source.numel() < (stop - start) * block_size:
            source = torch.nn.functional.pad(source, (0, (stop - start) * block_size - source.numel()))
        out.append((start, stop, source.view(stop - start, block_size)))
    return out


def _quantize_chunks(flat: torch.Tensor, block_size: int, qmax: float, codes: torch.Tensor) -> torch.Tensor:
    """Write the int8 codes of fp32 ``flat`` into ``codes`` ([blocks, block_size]); return the scales."""
    chunks = _chunks(flat, block_size)
    blocks = codes.shape[0]
    rows = max((stop - start for start, stop, _ in chunks), default=0)
    work = flat.new_empty(rows, block_size)
    half = flat.new_empty(rows, block_size)
    absmax = flat.new_empty(blocks)
    # amax propagates NaN and abs turns -inf into inf, so a block's maximum is finite exactly when
    # every element of the block is: no separate mask pass. (torch.aminmax over dim 1 reads once
    # but is not vectorized on CPU: 25x slower here.)
    for start, stop, source in chunks:
        torch.amax(torch.abs(source, out=work[:stop - start]), dim=1, out=absmax[start:stop])
    scales = torch.where(torch.isfinite(absmax), absmax / qmax, math.nan)
    usable = scales > 0  # False for 0 and NaN: those blocks get code 0
    divisor = torch.where(usable, scales, 1.0)[:, None]
    every_block_usable = bool(usable.all())  # zero or non-finite blocks are rare: skip their pass
    point_five = flat.new_full((), 0.5)
    for start, stop, source in chunks:
        y, sign_half = work[:stop - start], half[:stop - start]
        torch.div(source, divisor[start:stop], out=y)
        if not every_block_usable:
            y.masked_fill_(~usable[start:stop, None], 0.0)
        # Half away from zero, clamped: min(floor(|y| + 0.5), qmax) * sign(y). Clamping first gives
        # the same codes (qmax is an integer and rounding is monotonic); y + copysign(0.5, y) rounds
        # the sum in fp32 as |y| + 0.5 does (fp negation is exact), and the cast to int8 truncates
        # toward zero, so no separate trunc pass.
        y.clamp_(-qmax, qmax)
        torch.copysign(point_five, y, out=sign_half)
        codes[start:stop] = y.add_(sign_half)
    return scales


def dequantize_blockwise_reference(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    block_size: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch dequantization: ``code * scale`` in fp32, cast once to ``dtype`` (no validation).

    Args:
        codes: int8 codes or packed uint8 int4 codes, as :func:`quantize_blockwise` returns them.
        scales: fp32 per-block scales.
        bits: 8 or 4.
        block_size: elements per scale.
        numel: number of elements to produce.
        dtype: output dtype.
        out: optional contiguous tensor of ``numel`` elements and ``dtype`` to write into.

    Returns:
        ``out`` when given, else a flat ``[numel]`` tensor of ``dtype``, on the codes' device.
    """
    result = out if out is not None else torch.empty(numel, dtype=dtype, device=codes.device)
    # fp32: widened and scaled in the output itself; other dtypes: in fp32 first, cast once.
    values = result.view(-1) if dtype == torch.float32 else torch.empty(numel, device=codes.device)
    whole = numel // block_size
    head = whole * block_size
    if whole:
        _widen_codes(codes.reshape(-1)[:head if bits == 8 else head // 2], bits, values[:head])
        values[:head].view(whole, block_size).mul_(scales[:whole].view(-1, 1))
    if head < numel:  # the partial last block: its codes through a one-block buffer
        tail = values.new_empty(block_size)
        rest = codes.reshape(-1)[head if bits == 8 else head // 2:]
        filled = rest.numel() if bits == 8 else 2 * rest.numel()
        _widen_codes(rest, bits, tail[:filled])
        values[head:].copy_(tail[:numel - head].mul_(scales[whole]))
    if values is not result.view(-1):
        result.view(-1).copy_(values)
    return result


def _widen_codes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Write the integer value of every code in ``codes`` (flat) into fp32 ``out`` (one per code, or
    two per int4 byte)."""
    if bits == 8:
        out.copy_(codes)
        return
    # Arithmetic shifts of the signed byte sign-extend each 4-bit two's complement nibble:
    # low = (b << 4) >> 4, high = b >> 4; written straight into the even and odd elements.
    packed = codes.view(torch.int8)
    pairs = out.view(-1, 2)
    pairs[:, 0].copy_((packed << 4) >> 4)
    pairs[:, 1].copy_(packed >> 4)


def quantize_blockwise(
    x: torch.Tensor, *, bits: int = 8, block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` blockwise and symmetrically to int8 or packed int4 codes plus fp32 scales.

    Runs the Triton kernel on CUDA and the torch reference elsewhere; ``PLAIT_KERNEL_BACKEND``
    forces one (``triton`` on CPU needs ``TRITON_INTERPRET=1``). Both give the same bits. The
    format (rounding, packing, zeros, inf/NaN) is described in this module's docstring.

    Args:
        x: fp32, bf16 or fp16 tensor of any shape and strides (read flat in row-major order).
        bits: 8 (one int8 code per element) or 4 (two codes per uint8 byte).
        block_size: elements sharing one scale; a power of two in [2, 65536]. Smaller blocks
            mean smaller error and more scale bytes (4 bytes per block).

    Returns:
        ``(codes, scales)``: codes ``int8 [numel]`` or ``uint8 [ceil(numel/2)]``; scales
        ``float32 [ceil(numel/block_size)]``. ``|x - dequantize(codes, scales)| <= scale / 2`` per
        block, up to fp32 rounding (see the module docstring), for finite blocks.

    Raises:
        TypeError: x is not a tensor.
        ValueError: unsupported dtype, bits or block_size, or an invalid ``PLAIT_KERNEL_BACKEND``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_blockwise: x must be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"quantize_blockwise: x.dtype={x.dtype} is not supported; cast x to one of {_dtype_names()}."
        )
    _check_format(bits, block_size, "quantize_blockwise")
    use_triton = bool(x.numel()) and dispatch.select_backend(x) == dispatch.TRITON
    if torch.compiler.is_compiling():  # the custom op (quantize_op): opaque to torch.compile
        return torch.ops.plait.quantize_blockwise(x, bits, block_size, use_triton)
    return quantize_any(x, bits, block_size, use_triton)


def quantize_any(x: torch.Tensor, bits: int, block_size: int, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blockwise` on validated arguments, on the Triton path or the reference."""
    if use_triton:
        # Imported here, not at module top: CPU installs without Triton never reach this line.
        from plait.kernels.ops import quantize_triton

        return quantize_triton.quantize_blockwise_triton(x, bits=bits, block_size=block_size)
    return quantize_blockwise_reference(x, bits=bits, block_size=block_size)


def _check_dequantize_args(codes, scales, bits, block_size, numel, dtype, out) -> None:
    fn = "dequantize_blockwise"
    _check_format(bits, block_size, fn)
    for name, value in (("codes", codes), ("scales", scales)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}.")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"{fn}: numel={numel!r} must be an int >= 0: the element count that was quantized.")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{fn}: dtype={dtype} is not supported; pass one of {_dtype_names()}.")
    if codes.dtype != code_dtype(bits) or codes.numel() != code_numel(numel, bits):
        raise ValueError(
            f"{fn}: codes must be {code_dtype(bits)} with {code_numel(numel, bits)} elements for bits={bits}, "
            f"numel={numel}; got {codes.dtype} with {codes.numel()}. Pass the codes quantize_blockwise returned "
            f"with the same bits and numel."
        )
    if scales.dtype != torch.float32 or scales.numel() != num_blocks(numel, block_size):
        raise ValueError(
            f"{fn}: scales must be float32 with {num_blocks(numel, block_size)} elements for numel={numel}, "
            f"block_size={block_size}; got {scales.dtype} with {scales.numel()}. Pass the scales "
            f"quantize_blockwise returned with the same block_size."
        )
    if scales.device != codes.device:
        raise ValueError(f"{fn}: scales are on {scales.device} but codes on {codes.device}; move them together.")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.numel() != numel or out.dtype != dtype:
            raise ValueError(
                f"{fn}: out must be a {dtype} tensor of {numel} elements; pass out=None to allocate one."
            )
        if not out.is_contiguous() or out.device != codes.device:
            raise ValueError(f"{fn}: out must be contiguous and on {codes.device}; pass a contiguous buffer there.")


def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    block_size: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn codes and scales from :func:`quantize_blockwise` back into floating point.

    ``value = code * scale`` in fp32, cast once to ``dtype``. Dispatches like
    :func:`quantize_blockwise`; both backends give the same bits.

    Args:
        codes: ``int8 [numel]`` (8 bits) or packed ``uint8 [ceil(numel/2)]`` (4 bits).
        scales: ``float32 [ceil(numel/block_size)]``, on the codes' device.
        bits: 8 or 4, as quantized.
        block_size: as quantized.
        numel: number of elements that were quantized.
        dtype: fp32, bf16 or fp16 output.
        out: optional contiguous tensor of ``numel`` elements and ``dtype`` to write into (any
            shape; e.g. a slice of a gathered parameter buffer, saving a copy).

    Returns:
        ``out`` when given, else a new flat ``[numel]`` tensor of ``dtype``.

    Raises:
        TypeError: codes or scales is not a tensor.
        ValueError: bits, block_size, numel, dtype or out do not fit the codes and scales (the
            message says which and the fix), or ``PLAIT_KERNEL_BACKEND`` is invalid.
    """
    _check_dequantize_args(codes, scales, bits, block_size, numel, dtype, out)
    use_triton = bool(numel) and dispatch.select_backend(codes) == dispatch.TRITON
    if torch.compiler.is_compiling():  # the custom ops (quantize_op): opaque to torch.compile
        if out is None:
            return torch.ops.plait.dequantize_blockwise(codes, scales, bits, block_size, numel, dtype, use_triton)
        torch.ops.plait.dequantize_blockwise_into(codes, scales, bits, block_size, numel, out, use_triton)
        return out
    return dequantize_any(codes, scales, bits, block_size, numel, dtype, out, use_triton)


def dequantize_any(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
                   dtype: torch.dtype, out: torch.Tensor | None, use_triton: bool) -> torch.Tensor:
    """:func:`dequantize_blockwise` on validated arguments, on the Triton path or the reference."""
    if use_triton:
        from plait.kernels.ops import quantize_triton

        return quantize_triton.dequantize_blockwise_triton(
            codes, scales, bits=bits, block_size=block_size, numel=numel, dtype=dtype, out=out
        )
    return dequantize_blockwise_reference(
        codes, scales, bits=bits, block_size=block_size, numel=numel, dtype=dtype, out=out
    )
