"""The one Triton matrix-multiply step plait's kernels share (imports Triton).

``mma(a, b, acc, UPCAST, IEEE)`` accumulates ``a @ b`` into ``acc``. ``UPCAST`` multiplies in fp32:
the Triton 3.9 interpreter's bf16/fp16 ``tl.dot`` is wrong, so launchers set it under the
interpreter. ``IEEE`` asks for full-precision fp32 products instead of TF32 (fp32 inputs, where
the tests compare against fp64 references). Used by the grouped MoE GEMMs
(:mod:`plait.kernels.ops.moe_grouped_triton`) and plait-inference-kernels' paged attention.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):  # noqa: N803
    """``acc + a @ b`` with the precision the flags ask for."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
