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

CPU only for now: these are the pure-torch references and the CPU path. No Triton kernel exists
yet (the sign pack is a bandwidth-bound elementwise op; see the onebit-optim README's limits).
No autograd: these ops run on optimizer state, never inside a differentiated graph.
"""

from __future__ import annotations

import math

import torch

# Bit weights of the eight elements in one byte, least significant first.
_BIT_WEIGHTS = tuple(1 << i for i in range(8))


def packed_numel(numel: int) -> int:
    """Bytes that :func:`pack_signs` produces for ``numel`` elements (``ceil(numel / 8)``)."""
    return -(-numel // 8)


def signs_reference(x: torch.Tensor) -> torch.Tensor:
    """``+1.0`` where ``x >= 0``, else ``-1.0`` (fp32, same shape): the sign 1-bit compression keeps."""
    return torch.where(x >= 0, 1.0, -1.0).to(torch.float32)


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
    flat = x.reshape(-1)
    pad = packed_numel(flat.numel()) * 8 - flat.numel()
    bits = (flat >= 0).to(torch.uint8)
    if pad:
        bits = torch.cat((bits, bits.new_ones(pad)))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    # uint8 products and a uint8 sum of distinct powers of two cannot overflow (at most 255).
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``+-1.0`` values of the first ``numel`` signs in ``packed``.

    Args:
        packed: ``uint8`` bytes as :func:`pack_signs` returns them.
        numel: how many signs to read (at most ``8 * packed.numel()``).

    Returns:
        ``float32 [numel]`` of ``+1.0`` / ``-1.0``.

    Raises:
        TypeError: packed is not a uint8 tensor.
        ValueError: numel is negative or more than packed holds.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs: packed must be a uint8 torch.Tensor, got {_describe(packed)}.")
    if not 0 <= numel <= 8 * packed.numel():
        raise ValueError(
            f"unpack_signs: numel={numel} must be in [0, {8 * packed.numel()}] for {packed.numel()} packed bytes."
        )
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].to(torch.float32) * 2.0 - 1.0


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
    compensated = x + error
    n = compensated.numel()
    scale = torch.linalg.vector_norm(compensated) / math.sqrt(n) if n else compensated.new_zeros(())
    error.copy_(compensated - scale * signs_reference(compensated))
    return pack_signs(compensated), scale


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(dtype={value.dtype}, shape={tuple(value.shape)})"
    return type(value).__name__


__all__ = ["compress_with_error_feedback", "pack_signs", "packed_numel", "signs_reference", "unpack_signs"]
