"""Weight-only quantization (int8, int4, FP6 e3m2) of HF transformers models, reversibly.

>>> from plait.inference_kernels.quantization import QuantizeConfig, quantize, revert, quantized
>>> report = quantize(model, QuantizeConfig(kind="int4", group_size=64))  # Linears -> QuantizedLinear,
>>> # MoE *Experts -> QuantizedExperts
>>> revert(model)                                                        # the original modules back
>>> with quantized(model, QuantizeConfig(kind="int8")): model.generate(...)

A quantized HF export (compressed-tensors pack-quantized, ``plait ckpt convert --to hf``) loads with
:func:`load_quantized_pretrained`.

Families: those of :mod:`plait.inference_kernels.patching`. The formats and the matmul are the
``plait.kernels.ops.quant_matmul`` op unit. Listed in docs/patches.md.
"""

from plait.inference_kernels.quantization.apply import (
    QuantizeConfig,
    QuantizeReport,
    is_quantized,
    quantize,
    quantize_report,
    quantized,
    revert,
)
from plait.inference_kernels.quantization.experts import QuantizedExperts
from plait.inference_kernels.quantization.modules import QuantizedEmbedding, QuantizedLinear
from plait.inference_kernels.quantization.pretrained import load_quantized_pretrained

__all__ = [
    "QuantizeConfig",
    "QuantizeReport",
    "QuantizedEmbedding",
    "QuantizedExperts",
    "QuantizedLinear",
    "is_quantized",
    "load_quantized_pretrained",
    "quantize",
    "quantize_report",
    "quantized",
    "revert",
]
