"""Storage formats for optimizer state below fp32: pure torch, elementwise or blockwise, so every
result depends only on an element's own value (and its block), never on how tensors are sharded.

* bf16 states: round to nearest (``Tensor.to``).
* bf16 masters with stochastic rounding: the fp32 value's low 16 bits plus 16 bits of noise,
  truncated; rounds up with probability equal to the discarded fraction. The noise is a
  counter-based hash of (seed, step, parameter name, element index), so a value is rounded the same
  way whichever rank holds it and however the parameter is split into shards.
* int8 states, blockwise: each block of ``block`` consecutive elements is divided by its absmax
  (kept in fp32) and mapped to the nearest of 256 levels of a logarithmic map: for signed states
  (Adam's ``exp_avg``) 0 and +-127 levels from 1 down to 1e-7, for non-negative states
  (``exp_avg_sq``) 0 and 255 levels from 1 down to 1e-14 (a squared quantity spans twice the
  decades). Neighbouring levels differ by a factor of about 1.136, so a stored value is within
  about 6.8% of the original, relative to itself rather than to the block's absmax: small second
  moments are not flushed to zero as a linear map would do.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_SIGNED_DECADES, _UNSIGNED_DECADES = 7.0, 14.0


def _signed_levels() -> Tensor:
    magnitudes = torch.pow(10.0, -_SIGNED_DECADES * torch.arange(127, dtype=torch.float64) / 126)
    return torch.cat([-magnitudes, torch.zeros(1, dtype=torch.float64), magnitudes.flip(0)]).float()


def _unsigned_levels() -> Tensor:
    magnitudes = torch.pow(10.0, -_UNSIGNED_DECADES * torch.arange(255, dtype=torch.float64) / 254)
    return torch.cat([torch.zeros(1, dtype=torch.float64), magnitudes.flip(0)]).float()


LEVELS = {"signed": _signed_levels(), "unsigned": _unsigned_levels()}  # sorted ascending
_MIDPOINTS = {kind: (levels[1:] + levels[:-1]) / 2 for kind, levels in LEVELS.items()}


def quantize_blockwise(x: Tensor, kind: str, block: int) -> tuple[Tensor, Tensor]:
    """``x`` (any shape, fp32) as uint8 codes of its shape and one fp32 absmax per block of the
    flattened tensor (a last partial block is padded with zeros).

    Args:
        x: the state.
        kind: ``"signed"`` or ``"unsigned"`` (the map, see the module docstring).
        block: elements per block.

    Returns:
        ``(codes, absmax)``.
    """
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normalized = (blocks / scale[:, None]).reshape(-1)[:flat.numel()]
    codes = torch.bucketize(normalized, _MIDPOINTS[kind].to(x.device)).to(torch.uint8)
    return codes.view(x.shape), absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, kind: str, block: int) -> Tensor:
    """The fp32 state that :func:`quantize_blockwise` stored (its shape)."""
    values = LEVELS[kind].to(codes.device)[codes.reshape(-1).long()]
    pad = (-values.numel()) % block
    blocks = torch.nn.functional.pad(values, (0, pad)).view(-1, block) * absmax[:, None]
    return blocks.reshape(-1)[:values.numel()].view(codes.shape)


def int8_bytes(numel: int, block: int) -> int:
    """Bytes :func:`quantize_blockwise` keeps for ``numel`` elements: codes plus fp32 scales."""
    return numel + 4 * -(-numel // block)


def name_key(name: str) -> int:
    """A 32-bit identity for a parameter name (stable across processes, unlike ``hash``)."""
    return zlib.crc32(name.encode())


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash on int64 tensors holding values below 2**32 (constants below 2**31,
    so no product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def element_noise(numel: int, pieces: Sequence[tuple[str, int, int, int]], *, seed: int, step: int,
                  device: torch.device) -> Tensor:
    """16 bits of noise per element of a tensor made of pieces of parameters.

    Args:
        numel: elements of the tensor (a flat master shard or a whole parameter).
        pieces: ``(parameter name, first index in the parameter, length, offset in the tensor)``;
            elements outside every piece (padding) get zero noise.
        seed: the run's seed.
        step: the optimizer step (each step draws new noise).
        device: where the noise is made.

    Returns:
        int64 tensor of ``numel`` values in ``[0, 65536)``.
    """
    noise = torch.zeros(numel, dtype=torch.int64, device=device)
    for name, start, length, offset in pieces:
        key = int(_mix(torch.tensor([(name_key(name) ^ (seed * 0x9E3779B1) ^ (step * 0x85EBCA77)) & _MASK32]))[0])
        index = torch.arange(start, start + length, dtype=torch.int64, device=device)
        noise[offset:offset + length] = _mix(_mix(index) ^ key) & 0xFFFF
    return noise


def stochastic_round_bf16(x: Tensor, noise: Tensor) -> Tensor:
    """``x`` (fp32) rounded to bf16, up in magnitude with probability equal to the discarded
    fraction of its 16 low bits (``noise``: see :func:`element_noise`, flat, one per element)."""
    bits = x.detach().reshape(-1).view(torch.int32).to(torch.int64)
    # The int32 view holds the sign in bit 31 and the magnitude below it, so adding to the low
    # bits moves the magnitude whatever the sign; clearing them leaves a value bf16 holds exactly.
    rounded = ((bits + noise) & ~0xFFFF).to(torch.int32)
    keep = ~torch.isfinite(x.reshape(-1))  # inf/nan pass through unchanged
    rounded = torch.where(keep, bits.to(torch.int32), rounded)
    return rounded.view(torch.float32).to(torch.bfloat16).view(x.shape)
