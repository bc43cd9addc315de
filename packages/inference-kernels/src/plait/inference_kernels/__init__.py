"""plait-inference-kernels: fused inference kernels and the code that puts them into models.

Ops (each a Triton kernel on CUDA with a pure-torch reference elsewhere, chosen by
:func:`plait.kernels.dispatch.select_backend`; Triton is imported only when its path runs):

* :func:`fused_moe` / :func:`fused_experts` - a whole MoE block: top-k routing, token
  permutation, grouped expert GEMMs with the gated activation fused, weighted combine;
  :class:`FusedMoE` is the ``nn.Module`` form.
* :func:`paged_decode_attention` - decode attention over a paged (block-table) KV cache with GQA.
* :func:`write_kv_rotary` - rotate new keys (and queries) and write k and v into the paged cache
  in one kernel.
* :mod:`patching` - ``apply`` / ``revert`` plait's kernels in HF Llama, Mistral, Qwen2/3, Mixtral
  and Qwen-MoE models.
"""

# HF model patching: the subpackage imports neither transformers nor triton until a model is
# patched, so importing it here keeps `plait.inference_kernels.patching.apply(model)` one import away.
from plait.inference_kernels import patching
from plait.inference_kernels.moe import (
    ACTIVATIONS,
    BlockAlignment,
    FusedMoE,
    FusedMoEConfig,
    align_tokens_to_blocks,
    fused_experts,
    fused_experts_reference,
    fused_moe,
    topk_routing,
    topk_routing_reference,
)
from plait.inference_kernels.paged_attention import (
    SUPPORTED_HEAD_SIZES,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from plait.inference_kernels.paged_attention_kv_write import write_kv_rotary, write_kv_rotary_reference

__all__ = [
    "ACTIVATIONS",
    "SUPPORTED_HEAD_SIZES",
    "BlockAlignment",
    "FusedMoE",
    "FusedMoEConfig",
    "align_tokens_to_blocks",
    "patching",
    "fused_experts",
    "fused_experts_reference",
    "fused_moe",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "topk_routing",
    "topk_routing_reference",
    "write_kv_rotary",
    "write_kv_rotary_reference",
]
