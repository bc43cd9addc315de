"""plait's kernels, one module pair per op: ``<op>.py`` (public function, torch reference,
``nn.Module``) and ``<op>_triton.py`` (kernels, launchers, autograd Function; imports Triton).

Only the torch side is imported here, so this package imports on machines without Triton.
"""

from plait.kernels.ops import (
    quantize_op,  # noqa: F401 - registers the plait::quantize_blockwise custom ops
    rms_norm_op,  # noqa: F401 - registers the plait::rms_norm custom ops
    rotary_op,  # noqa: F401 - registers the plait::rotary custom ops
    sign_op,  # noqa: F401 - registers the plait::pack_signs custom ops
)
from plait.kernels.ops.gated_activation import (
    GeluAndMul,
    SiluAndMul,
    gated_activation_reference,
    gelu_and_mul,
    silu_and_mul,
)
from plait.kernels.ops.moe_grouped import gate_product, grouped_gated_mlp, grouped_gated_mlp_reference
from plait.kernels.ops.moe_permute import (
    BlockAlignment,
    align_tokens_to_blocks,
    combine_rows,
    combine_rows_reference,
    permute_by_expert,
    permute_tokens,
    permute_tokens_reference,
)
from plait.kernels.ops.quant_matmul import QuantScheme, quant_matmul, quant_matmul_reference, quantize_weight
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
    scaled_signs,
    signs_reference,
    unpack_bits,
    unpack_signs,
)

__all__ = [
    "BlockAlignment",
    "QuantScheme",
    "GeluAndMul",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "align_tokens_to_blocks",
    "apply_rotary",
    "combine_rows",
    "combine_rows_reference",
    "compress_with_error_feedback",
    "dequantize_blockwise",
    "dequantize_blockwise_reference",
    "gate_product",
    "gated_activation_reference",
    "gelu_and_mul",
    "grouped_gated_mlp",
    "grouped_gated_mlp_reference",
    "pack_signs",
    "packed_numel",
    "permute_by_expert",
    "permute_tokens",
    "permute_tokens_reference",
    "quant_matmul",
    "quant_matmul_reference",
    "quantize_weight",
    "quantize_blockwise",
    "quantize_blockwise_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_cos_sin",
    "rotary_embedding",
    "rotate_reference",
    "scaled_signs",
    "signs_reference",
    "silu_and_mul",
    "unpack_bits",
    "unpack_signs",
]
