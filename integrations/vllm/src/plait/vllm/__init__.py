"""plait.vllm: plait's kernels and universal checkpoints inside vLLM, by installing one package.

vLLM finds this package through its ``vllm.general_plugins`` entry point (``plait =
"plait.vllm:register"``) and calls :func:`register` once in every process it starts. That
registers plait's layers with ``CustomOp.register_oot`` (RMSNorm with the fused residual,
SiluAndMul, GeluAndMul, RotaryEmbedding) and the ``plait_universal`` model loader with
``register_model_loader``. Nothing in vLLM is edited. ``PLAIT_VLLM=0`` (or vLLM's own
``VLLM_PLUGINS`` filter) turns it off.

This module imports neither vLLM nor torch: the vLLM side is imported by :func:`register` only.
"""

from __future__ import annotations

from plait.vllm.plugin import SUPPORTED_VLLM, RegistrationReport, register, registration_report

__all__ = ["SUPPORTED_VLLM", "RegistrationReport", "register", "registration_report"]
