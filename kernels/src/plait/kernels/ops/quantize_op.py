"""Blockwise quantization as ``torch.library`` custom ops, for torch.compile.

``plait::quantize_blockwise`` returns ``(codes, scales)``; ``plait::dequantize_blockwise`` returns a
new tensor and ``plait::dequantize_blockwise_into`` writes a given buffer (declared as mutated).
They run the functions of :mod:`plait.kernels.ops.quantize` on real tensors (the reference skips
its pass over unusable blocks after reading whether any exists, a data-dependent branch dynamo
cannot trace) and have shape-only fakes. The public functions call them only while compiling;
eager calls keep their direct path (no dispatcher round trip on ZeRO++'s communication path). No
autograd: the codes are integers and these ops move tensors through collectives.
"""

from __future__ import annotations

import torch

from plait.kernels.ops import quantize


@torch.library.custom_op("plait::quantize_blockwise", mutates_args=())
def _quantize_op(x: torch.Tensor, bits: int, block_size: int, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize.quantize_any(x, bits, block_size, use_triton)
    return codes.clone(), scales  # codes: a fresh tensor, not a view of the padded work buffer


@_quantize_op.register_fake
def _quantize_fake(x, bits, block_size, use_triton):
    numel = x.numel()
    return (x.new_empty(quantize.code_numel(numel, bits), dtype=quantize.code_dtype(bits)),
            x.new_empty(quantize.num_blocks(numel, block_size), dtype=torch.float32))


@torch.library.custom_op("plait::dequantize_blockwise", mutates_args=())
def _dequantize_op(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
                   dtype: torch.dtype, use_triton: bool) -> torch.Tensor:
    return quantize.dequantize_any(codes, scales, bits, block_size, numel, dtype, None, use_triton)


@_dequantize_op.register_fake
def _dequantize_fake(codes, scales, bits, block_size, numel, dtype, use_triton):
    return codes.new_empty(numel, dtype=dtype)


@torch.library.custom_op("plait::dequantize_blockwise_into", mutates_args=("out",))
def _dequantize_into_op(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
                        out: torch.Tensor, use_triton: bool) -> None:
    quantize.dequantize_any(codes, scales, bits, block_size, numel, out.dtype, out, use_triton)


@_dequantize_into_op.register_fake
def _dequantize_into_fake(codes, scales, bits, block_size, numel, out, use_triton):
    return None
