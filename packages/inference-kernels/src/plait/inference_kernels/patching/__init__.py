"""Put plait's kernels into HF transformers models, reversibly.

>>> from plait.inference_kernels.patching import apply, revert, patched
>>> report = apply(model)          # RMSNorm, gated MLP, rotary (and MoE gate) -> plait ops
>>> revert(model)                  # exactly as before
>>> with patched(model): model.generate(...)

Families: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe (``config.model_type``);
transformers >=5.0,<6.0. transformers is imported only when a model is patched. Every host patch
is listed in docs/patches.md.
"""

from plait.inference_kernels.patching.apply import (
    PatchConfig,
    PatchReport,
    apply,
    is_patched,
    patch_report,
    patched,
    revert,
)
from plait.inference_kernels.patching.registry import (
    FAMILIES,
    TRANSFORMERS_RANGE,
    FamilySpec,
    UnsupportedModelError,
    UnsupportedTransformersError,
    check_transformers_version,
    supported_families,
)

__all__ = [
    "FAMILIES",
    "TRANSFORMERS_RANGE",
    "FamilySpec",
    "PatchConfig",
    "PatchReport",
    "UnsupportedModelError",
    "UnsupportedTransformersError",
    "apply",
    "check_transformers_version",
    "is_patched",
    "patch_report",
    "patched",
    "revert",
    "supported_families",
]
