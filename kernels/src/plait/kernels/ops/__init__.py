"""plait's kernels, one module pair per op: ``<op>.py`` (public function, torch reference,
``nn.Module``) and ``<op>_triton.py`` (kernels, launchers, autograd Function; imports Triton).

Only the torch side is imported here, so this package imports on machines without Triton.
"""

from plait.kernels.ops.gated_activation import (
    GeluAndMul,
    SiluAndMul,
    gated_activation_reference,
    gelu_and_mul,
    silu_and_mul,
)
from plait.kernels.ops.quantize import (
    dequantize_blockwise,
    dequantize_blockwise_reference,
    quantize_blockwise,
    quantize_blockwise_reference,
)
from plait.kernels.ops.rms_norm import RMSNorm, rms_norm, rms_norm_reference
from plait.kernels.ops.rotary import (
    RotaryEmbedding,
    apply_rotary,
    rotary_cos_sin,
    rotary_embedding,
    rotate_reference,
)
from plait.kernels.ops.sign import (
    compress_with_error_feedback,
    pack_signs,
    packed_numel,
    signs_reference,
    unpack_signs,
)

__all__ = [
    "GeluAndMul",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "apply_rotary",
    "compress_with_error_feedback",
    "dequantize_blockwise",
    "dequantize_blockwise_reference",
    "gated_activation_reference",
    "gelu_and_mul",
    "pack_signs",
    "packed_numel",
    "quantize_blockwise",
    "quantize_blockwise_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_cos_sin",
    "rotary_embedding",
    "rotate_reference",
    "signs_reference",
    "silu_and_mul",
    "unpack_signs",
]
