"""1-bit sign compression with a scale and error feedback: the op units of 1-bit Adam/LAMB.

The compressed all-reduce (:func:`plait.kernels.collectives.compressed_allreduce`) sends each
element as one bit, its sign, plus one fp32 scale for a whole chunk, and keeps what the
compression lost in an *error-feedback* buffer that is added back before the next compression
(Seide et al. 2014; DeepSpeed's 1-bit Adam). Format, shared by every path:

* ``pack_signs``: element ``8j + i`` of the flat input becomes bit ``i`` (least significant
  first) of byte ``j``; the bit is 1 when the element is ``>= 0``. Zero counts as positive,
  because one bit cannot say zero (hence the momentum masks of the optimizers), and NaN counts
  as negative. A partial last byte is padded with 1 bits (as if +0 followed).
* ``unpack_signs``: bit 1 -> +1.0, bit 0 -> -1.0, the first ``numel`` elements.
* ``compress_with_error_feedback(x, error)``: ``c = x + error``; ``scale = ||c||_2 / sqrt(n)``
  (the scale that keeps the L2 norm of ``scale * sign(c)`` equal to ``||c||``);
  ``error <- c - scale * sign(c)`` in place; returns ``(pack_signs(c), scale)``. Everything in
  fp32: the buffers of the optimizers are fp32 whatever the parameters' dtype.

Backends (the op pattern of docs/conventions.md): :func:`pack_signs`, :func:`unpack_bits`,
:func:`unpack_signs` and :func:`compress_with_error_feedback` pick one with
:func:`plait.kernels.dispatch.select_backend`: the Triton kernels of ``sign_triton`` (imported only
when chosen) on CUDA tensors, the torch code below elsewhere; ``PLAIT_KERNEL_BACKEND`` forces one
(``triton`` on CPU needs ``TRITON_INTERPRET=1``, how the tests run the kernels). Both give the same
bits, scale and error included: the compression's scale is torch's ``vector_norm`` on both paths
(why: ``sign_triton``'s docstring), and its Triton part fuses sign, pack and the error update
into one pass over ``c``. The torch code is the CPU path and the oracle the kernels are tested
against. No autograd: these ops run on optimizer state, never inside a differentiated graph.
"""

from __future__ import annotations

import math
import sys

import torch

from plait.kernels import dispatch

# Bit weights of the eight elements in one byte, least significant first.
_BIT_WEIGHTS = tuple(1 << i for i in range(8))


def packed_numel(numel: int) -> int:
    """Bytes that :func:`pack_signs` produces for ``numel`` elements (``ceil(numel / 8)``)."""
    return -(-numel // 8)


def signs_reference(x: torch.Tensor) -> torch.Tensor:
    """``+1.0`` where ``x >= 0``, else ``-1.0`` (fp32, same shape): the sign 1-bit compression keeps."""
    return torch.where(x >= 0, 1.0, -1.0).to(torch.float32)  # plainly written: the oracle's form


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Flat bool ``bits`` (a multiple of 8 long) -> one uint8 per 8, bit ``i`` = element ``8j + i``."""
    if sys.byteorder != "little":  # the int64 view below reads bytes in little-endian order
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
        return (bits.view(torch.uint8).view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
    # Eight 0/1 bytes read as one little-endian int64 hold element i at bit 8i. Three folds
    # (OR with the word shifted right by 7, 14, 28) gather them: after the first, byte k holds
    # elements k and k+1 in its bits 0-1, after the second k..k+3 in bits 0-3, after the third
    # byte 0 holds all eight. The other bytes hold leftovers, dropped by reading every eighth
    # byte. The words stay non-negative (bit 63 is never set), so the shifts bring in zeros.
    words = bits.view(torch.uint8).view(torch.int64).clone()
    shifted = torch.empty_like(words)
    for shift in (7, 14, 28):
        torch.bitwise_right_shift(words, shift, out=shifted)
        words |= shifted
    return words.view(torch.uint8)[::8].clone()


# Row ``v``: the eight signs byte ``v`` encodes (+1.0 for a 1 bit, element ``i`` from bit ``i``).
# Unpacking is one gather of 32-byte rows (CPU: an order of magnitude faster than shifting bits).
_SIGN_TABLE = torch.tensor([[1.0 if (v >> i) & 1 else -1.0 for i in range(8)] for v in range(256)])
_BIT_TABLE = _SIGN_TABLE > 0


def _gather_rows(table: torch.Tensor, packed: torch.Tensor, numel: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``table[byte]`` for every byte of ``packed``, flat, its first ``numel`` elements (into
    ``out`` when given: a flat tensor of ``numel`` elements of the table's dtype)."""
    flat = packed.reshape(-1)
    index = flat[: packed_numel(numel)].long()
    table = table.to(packed.device)
    whole = numel // 8
    if out is None:
        return table.index_select(0, index).view(-1)[:numel]
    torch.index_select(table, 0, index[:whole], out=out[: 8 * whole].view(whole, 8))
    if numel > 8 * whole:  # a partial last byte
        out[8 * whole:] = table[index[whole]][: numel - 8 * whole]
    return out


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``x`` eight to a byte.

    Args:
        x: a floating-point tensor of any shape, read flat in row-major order.

    Returns:
        ``uint8 [ceil(numel / 8)]`` on x's device (format in the module docstring).

    Raises:
        TypeError: x is not a floating-point tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"pack_signs: x must be a floating-point torch.Tensor, got {_describe(x)}.")
    use_triton = bool(x.numel()) and dispatch.select_backend(x) == dispatch.TRITON
    if torch.compiler.is_compiling():
        return torch.ops.plait.pack_signs(x, use_triton)  # the custom op (sign_op): opaque to torch.compile
    return pack_signs_any(x, use_triton)


def pack_signs_any(x: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """:func:`pack_signs` on a validated ``x``, on the Triton path or the torch one."""
    if use_triton:
        from plait.kernels.ops import sign_triton  # imported here: CPU installs without Triton never reach it

        return sign_triton.pack_signs_triton(x)
    bits = x.reshape(-1) >= 0
    pad = packed_numel(bits.numel()) * 8 - bits.numel()
    if pad:
        bits = torch.cat((bits, bits.new_ones(pad)))
    return _pack_bits(bits)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` sign bits in ``packed`` as a bool tensor (True: ``>= 0``).

    Args:
        packed: ``uint8`` bytes as :func:`pack_signs` returns them.
        numel: how many signs to read (at most ``8 * packed.numel()``).

    Returns:
        ``bool [numel]``.

    Raises:
        TypeError: packed is not a uint8 tensor.
        ValueError: numel is negative or more than packed holds.
    """
    _check_packed(packed, numel)
    return _unpack(packed, numel, as_signs=False)


def _unpack(packed: torch.Tensor, numel: int, *, as_signs: bool) -> torch.Tensor:
    use_triton = bool(numel) and dispatch.select_backend(packed) == dispatch.TRITON
    if torch.compiler.is_compiling():
        return torch.ops.plait.unpack_signs(packed, numel, as_signs, use_triton)  # the custom op (sign_op)
    return unpack_any(packed, numel, as_signs, use_triton)


def unpack_any(packed: torch.Tensor, numel: int, as_signs: bool, use_triton: bool) -> torch.Tensor:
    """:func:`unpack_signs` (``as_signs``) or :func:`unpack_bits` on validated arguments."""
    if use_triton:
        from plait.kernels.ops import sign_triton

        return sign_triton.unpack_triton(packed, numel, as_signs=as_signs)  # one pass: bits straight to values
    return _gather_rows(_SIGN_TABLE if as_signs else _BIT_TABLE, packed, numel)


def _check_packed(packed: object, numel: int) -> None:
    """Refuse what :func:`unpack_bits` / :func:`unpack_signs` cannot read (see their Raises)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs: packed must be a uint8 torch.Tensor, got {_describe(packed)}.")
    if not 0 <= numel <= 8 * packed.numel():
        raise ValueError(
            f"unpack_signs: numel={numel} must be in [0, {8 * packed.numel()}] for {packed.numel()} packed bytes."
        )


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``+-1.0`` values of the first ``numel`` signs in ``packed`` (see :func:`unpack_bits`).

    Returns:
        ``float32 [numel]`` of ``+1.0`` / ``-1.0``.

    Raises:
        TypeError, ValueError: as :func:`unpack_bits`.
    """
    _check_packed(packed, numel)
    return _unpack(packed, numel, as_signs=True)


def _plus_minus_one(bits: torch.Tensor) -> torch.Tensor:
    # 2b - 1 in fp32: several times faster on CPU than torch.where with scalar branches.
    return bits.to(torch.float32).mul_(2.0).sub_(1.0)


def scaled_signs(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``+scale`` where ``bits`` is True, else ``-scale`` (fp32; ``scale`` broadcasts).

    Equal bit for bit to ``signs * scale``: multiplying by +-1 is exact.
    """
    return _plus_minus_one(bits).mul_(scale)


def unpack_scaled_signs(packed: torch.Tensor, numel: int, scale: torch.Tensor, *,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``+scale`` / ``-scale`` for the first ``numel`` signs in ``packed``: the decoded values of a
    compressed chunk, equal bit for bit to ``unpack_signs(packed, numel) * scale``.

    Args:
        packed: ``uint8`` bytes as :func:`pack_signs` returns them.
        numel: how many values to decode.
        scale: a 0-d (or one-element) fp32 tensor.
        out: optional flat fp32 tensor of ``numel`` elements to write into (no allocation).

    Returns:
        ``float32 [numel]`` (``out`` when given).

    Raises:
        TypeError, ValueError: as :func:`unpack_bits`.
    """
    _check_packed(packed, numel)
    use_triton = bool(numel) and dispatch.select_backend(packed) == dispatch.TRITON
    if torch.compiler.is_compiling():  # the custom op (sign_op); ``out`` is filled by a traced copy
        values = torch.ops.plait.unpack_scaled_signs(packed, numel, scale, use_triton)
        return values if out is None else out.copy_(values)
    return unpack_scaled_any(packed, numel, scale, use_triton, out)


def unpack_scaled_any(packed: torch.Tensor, numel: int, scale: torch.Tensor, use_triton: bool,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`unpack_scaled_signs` on validated arguments, on the Triton path or the torch one."""
    if use_triton:
        from plait.kernels.ops import sign_triton

        return sign_triton.unpack_triton(packed, numel, as_signs=True, scale=scale, out=out)  # one pass
    # The CPU path: one gather from a table of +-scale (scale times +-1 is exact).
    return _gather_rows(_SIGN_TABLE.to(packed.device) * scale.reshape(()), packed, numel, out)


# Elements per piece of the CPU compression's sign/pack/error pass: 1 MiB of fp32, so the piece's
# temporaries (its bits, words, and +-scale values) are reused heap memory that stays in cache,
# instead of tensors of the whole buffer's size (fresh pages on every call). A multiple of 8.
_PIECE = 1 << 18


def compress_with_error_feedback(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the error feedback, compress to signs and one scale, and keep the new error.

    Args:
        x: the flat fp32 tensor to send (not modified).
        error: flat fp32 error-feedback buffer of the same size, updated in place to what this
            compression loses (``c - scale * sign(c)`` with ``c = x + error``).

    Returns:
        ``(packed, scale)``: ``uint8 [ceil(n / 8)]`` signs of ``c`` and a 0-d fp32 scale
        ``||c||_2 / sqrt(n)`` (0 for an empty tensor).

    Raises:
        ValueError: x and error are not flat fp32 tensors of the same size.
    """
    if x.dtype != torch.float32 or error.dtype != torch.float32 or x.dim() != 1 or x.shape != error.shape:
        raise ValueError(
            "compress_with_error_feedback: x and error must be flat float32 tensors of one size, got "
            f"{_describe(x)} and {_describe(error)}; flatten and cast them (the optimizers keep fp32 buffers)."
        )
    use_triton = bool(x.numel()) and dispatch.select_backend(x) == dispatch.TRITON
    if torch.compiler.is_compiling():  # the custom op (sign_op), which updates error in place
        return torch.ops.plait.compress_with_error_feedback(x, error, use_triton)
    return compress_any(x, error, use_triton)


def compress_any(x: torch.Tensor, error: torch.Tensor, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compress_with_error_feedback` on validated arguments, on the Triton path or the torch one."""
    compensated = error.add_(x)  # the error buffer becomes c, then what c loses: no temporary of n floats
    n = compensated.numel()
    scale = torch.linalg.vector_norm(compensated) / math.sqrt(n) if n else compensated.new_zeros(())
    if use_triton:
        from plait.kernels.ops import sign_triton

        return sign_triton.sign_and_error_triton(compensated, scale), scale  # the fused sign/pack/error pass
    packed = torch.empty(packed_numel(n), dtype=torch.uint8, device=compensated.device)
    table = _SIGN_TABLE.to(compensated.device) * scale  # +-scale: exact
    for start in range(0, n, _PIECE):  # piece by piece (see _PIECE); every piece but the last is whole bytes
        piece = compensated[start: start + _PIECE]
        bits = piece >= 0
        pad = packed_numel(bits.numel()) * 8 - bits.numel()
        piece_packed = _pack_bits(torch.cat((bits, bits.new_ones(pad))) if pad else bits)
        packed[start // 8: start // 8 + piece_packed.numel()] = piece_packed
        piece.sub_(_gather_rows(table, piece_packed, piece.numel()))  # c - scale * sign(c)
    return packed, scale


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(dtype={value.dtype}, shape={tuple(value.shape)})"
    return type(value).__name__


__all__ = [
    "compress_with_error_feedback", "pack_signs", "packed_numel", "scaled_signs", "signs_reference", "unpack_bits",
    "unpack_scaled_signs", "unpack_signs",
]
