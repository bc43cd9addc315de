"""1-bit sign compression as ``torch.library`` custom ops, for torch.compile.

``plait::pack_signs``, ``plait::unpack_signs`` (``+-1.0`` values or, ``as_signs=False``, bits),
``plait::unpack_scaled_signs`` and ``plait::compress_with_error_feedback`` (which updates the
error buffer in place, declared as mutated) run the functions of :mod:`plait.kernels.ops.sign`
on real tensors and have shape-only fakes, so a compiled optimizer step keeps each as one opaque
call: no graph break at the bit packing's integer views, no data-dependent guard. The public
functions call them only while compiling; eager calls keep their direct path (no dispatcher
round trip on the optimizers' hot path). No autograd: these ops run on optimizer state.
"""

from __future__ import annotations

import torch

from plait.kernels.ops import sign


@torch.library.custom_op("plait::pack_signs", mutates_args=())
def _pack_op(x: torch.Tensor, use_triton: bool) -> torch.Tensor:
    return sign.pack_signs_any(x, use_triton)


@_pack_op.register_fake
def _pack_fake(x, use_triton):
    return x.new_empty(sign.packed_numel(x.numel()), dtype=torch.uint8)


@torch.library.custom_op("plait::unpack_signs", mutates_args=())
def _unpack_op(packed: torch.Tensor, numel: int, as_signs: bool, use_triton: bool) -> torch.Tensor:
    return sign.unpack_any(packed, numel, as_signs, use_triton).clone()  # a fresh tensor, not a table view


@_unpack_op.register_fake
def _unpack_fake(packed, numel, as_signs, use_triton):
    return packed.new_empty(numel, dtype=torch.float32 if as_signs else torch.bool)


@torch.library.custom_op("plait::unpack_scaled_signs", mutates_args=())
def _unpack_scaled_op(packed: torch.Tensor, numel: int, scale: torch.Tensor, use_triton: bool) -> torch.Tensor:
    return sign.unpack_scaled_any(packed, numel, scale, use_triton).clone()


@_unpack_scaled_op.register_fake
def _unpack_scaled_fake(packed, numel, scale, use_triton):
    return packed.new_empty(numel, dtype=torch.float32)


@torch.library.custom_op("plait::compress_with_error_feedback", mutates_args=("error",))
def _compress_op(x: torch.Tensor, error: torch.Tensor, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return sign.compress_any(x, error, use_triton)


@_compress_op.register_fake
def _compress_fake(x, error, use_triton):
    return x.new_empty(sign.packed_numel(x.numel()), dtype=torch.uint8), x.new_empty((), dtype=torch.float32)
