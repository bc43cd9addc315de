"""The one tolerance table of the project: how far a kernel may be from its reference, and why.

Every test that compares a Triton kernel (or any fast path) with its pure-torch reference takes
its ``atol``/``rtol`` from :data:`TOLERANCES` through :func:`tolerance`, never from a literal in
the test. A tolerance is a claim about numerics, so each entry carries the reason it is as large
as it is; a reviewer who wants to tighten one knows what argument to beat.

Keys are ``(op, dtype)`` where ``op`` names the op and the pass, e.g. ``"rms_norm_fwd"`` or
``"rms_norm_bwd"``, and ``dtype`` is the dtype of the op's inputs. To add an op, add one entry per
dtype it supports, each with its reason (small, in-place edits: several packages add rows here).

The comparison is ``|actual - expected| <= atol + rtol * |expected|`` (``torch.testing.assert_close``).
Useful numbers: one unit in the last place (ulp) relative to the value is at most 2^-23 ~ 1.2e-7
for fp32, 2^-10 ~ 9.8e-4 for fp16 and 2^-7 ~ 7.8e-3 for bf16 (8 significant bits, 7 stored).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """An allowed difference between a fast path and its reference.

    Attributes:
        atol: absolute tolerance (covers values near zero, where relative error means nothing).
        rtol: relative tolerance, as a fraction of the reference value.
        reason: why these numbers: where the two computations round differently.
    """

    atol: float
    rtol: float
    reason: str

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Tolerance.{name}={value!r} must be a finite number >= 0; pass e.g. 1e-5.")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(
                "Tolerance.reason is empty; say where the fast path and the reference round differently."
            )

    def assert_close(self, actual: torch.Tensor, expected: torch.Tensor, *, what: str = "") -> None:
        """Assert ``actual`` matches ``expected`` within this tolerance (dtypes and shapes must match).

        Args:
            actual: the fast path's tensor.
            expected: the reference's tensor.
            what: a label for the failure message, e.g. ``"rms_norm dx bf16 (3, 33)"``.

        Raises:
            AssertionError: the tensors differ by more than the tolerance; the message gives the
                worst element and this entry's reason.
        """
        torch.testing.assert_close(
            actual, expected, atol=self.atol, rtol=self.rtol,
            msg=lambda default: f"{what}: {default}\nTolerance reason: {self.reason}",
        )


_FP32_REDUCTION = (
    "both sides reduce in fp32 but in a different order (Triton's tree reduction over the padded "
    "block vs torch's vectorised sum), so they differ by a few fp32 ulps of the row's sum of squares; "
    "the output is then one multiply away"
)
_REFERENCE_ROUNDS_TWICE = (
    "With a residual the torch reference rounds the normalisation's gradient to the input dtype "
    "(autograd through its h.float() cast) and rounds again when it adds the gradient of the returned "
    "h, while the kernel adds in fp32 and rounds once; with a possible flip of the final rounding that "
    "is up to about 2 ulps apart"
)

# Observed worst cases quoted below come from a sweep of seeds 0-2, rows 1/3/17/64, hidden
# 1/7/33/130/1000/4096, with/without residual, offset 0/1, Triton under TRITON_INTERPRET=1 vs the reference.
TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    # ---- rms_norm forward: y = x * rsqrt(mean(x^2) + eps) * (offset + w), all in fp32, one cast.
    ("rms_norm_fwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-5,
        reason=_FP32_REDUCTION + "; observed at most 3.5e-7 relative, 1e-5 keeps a wide margin.",
    ),
    ("rms_norm_fwd", torch.bfloat16): Tolerance(
        atol=1e-5, rtol=1.6e-2,
        reason="bf16 has 8 significant bits. The reference also computes in fp32 and casts once, so the "
               "only difference is that a few-ulp fp32 difference can flip the final rounding: one bf16 "
               "ulp, at most 2^-7 = 7.8e-3 relative (observed 6.9e-3); rtol 1.6e-2 allows two. The residual "
               "sum h is bitwise equal (both round x + residual to nearest even once).",
    ),
    ("rms_norm_fwd", torch.float16): Tolerance(
        atol=1e-5, rtol=2e-3,
        reason="fp16 has 11 significant bits; as for bf16 the difference is one flipped final rounding, "
               "at most 2^-10 = 9.8e-4 relative (observed 9.6e-4); rtol 2e-3 allows two ulps; atol covers "
               "fp16 subnormals.",
    ),
    # ---- rms_norm backward: dx = rstd * (dn - n * mean(dn * n)), dn = dy * (offset + w);
    # dw = sum over rows of dy * n. fp32 throughout in both, one cast at the end in the kernel.
    ("rms_norm_bwd", torch.float32): Tolerance(
        atol=5e-5, rtol=1e-4,
        reason="dx subtracts n * mean(dn * n) from dn, so an fp32 reduction-order difference in the mean "
               "(autograd's graph vs the kernel's formula) is amplified where the terms nearly cancel, and "
               "grows with the hidden size; dw sums over all rows in a different order (per-program "
               "partials, then a torch sum). Observed at most 2.5e-5 absolute (hidden 4096).",
    ),
    ("rms_norm_bwd", torch.bfloat16): Tolerance(
        atol=1e-2, rtol=2.4e-2,
        reason=_REFERENCE_ROUNDS_TWICE + " (observed: one element 2 ulps off, 0.0625 at |dx| ~ 4.4); "
               "rtol 2.4e-2 is 3 bf16 ulps. atol 1e-2 covers dx elements where dn and n*mean(dn*n) "
               "cancel: their bf16 value is a rounding of a tiny difference of O(1) fp32 terms.",
    ),
    ("rms_norm_bwd", torch.float16): Tolerance(
        atol=2e-3, rtol=3e-3,
        reason=_REFERENCE_ROUNDS_TWICE + " (observed 2 fp16 ulps, 7.8e-3 at |dx| ~ 4-8); rtol 3e-3 is 3 "
               "ulps. atol 2e-3 covers dx elements where the two terms of the backward formula cancel.",
    ),
    # ---- gated_activation (silu_and_mul / gelu_and_mul), forward: act(g) * u in fp32, one cast;
    # backward: dg = dy * u * act'(g), du = dy * act(g), fp32, one cast. No reduction anywhere.
    ("gated_activation_fwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="element-wise, but sigmoid/erf/exp are different implementations (Triton's or numpy's "
               "under the interpreter vs torch's vectorised ones). sigmoid agrees to a few ulps "
               "(2.4e-7 absolute at |x| ~ 4); erf less so: observed 1.5e-6 absolute, 4.4e-5 relative on "
               "a small GELU output, which rtol 1e-4 / atol 1e-5 cover with 2x margin.",
    ),
    ("gated_activation_fwd", torch.bfloat16): Tolerance(
        atol=1e-5, rtol=1.6e-2,
        reason="both paths compute in fp32 and cast once; a few-ulp fp32 difference in the activation "
               "can flip that one bf16 rounding (2^-7 relative); rtol 1.6e-2 allows two ulps.",
    ),
    ("gated_activation_fwd", torch.float16): Tolerance(
        atol=1e-5, rtol=2e-3,
        reason="as for bf16: one flipped fp16 rounding of an fp32 result, 2^-10 relative; two ulps allowed.",
    ),
    ("gated_activation_bwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-5,
        reason="the kernel's closed-form derivative (s*(1+g*(1-s)) for SiLU, the normal density for GELU) "
               "vs autograd's chain of torch backward kernels: the same formulas, different "
               "transcendental implementations and operation order; a few fp32 ulps.",
    ),
    ("gated_activation_bwd", torch.bfloat16): Tolerance(
        atol=1e-4, rtol=1.6e-2,
        reason="fp32 on both sides, one bf16 cast of each gradient; a flipped rounding is one bf16 ulp "
               "(2 allowed); atol covers gradients of gates near the activation's flat region.",
    ),
    ("gated_activation_bwd", torch.float16): Tolerance(
        atol=1e-5, rtol=2e-3,
        reason="fp32 on both sides, one fp16 cast; two fp16 ulps allowed.",
    ),
    # ---- rotary (apply_rotary / rotary_embedding): o1 = x1*c - x2*s, o2 = x2*c + x1*s in fp32, one
    # cast; the backward is the same rotation with -s.
    ("rotary_fwd", torch.float32): Tolerance(
        atol=1e-6, rtol=1e-5,
        reason="the same two products and one add in the same order (bitwise equal under the "
               "interpreter); a GPU compiler may contract them into an FMA, which changes the result by "
               "up to an ulp of the larger product, so a few fp32 ulps of |x| are allowed.",
    ),
    ("rotary_fwd", torch.bfloat16): Tolerance(
        atol=1e-3, rtol=1.6e-2,
        reason="fp32 on both sides, one bf16 cast: a flipped rounding is one bf16 ulp (2^-7 relative, two "
               "allowed); where x1*c and x2*s nearly cancel, an FMA-contracted fp32 result differs by an "
               "ulp of the products, which atol 1e-3 (for O(1) inputs) covers.",
    ),
    ("rotary_fwd", torch.float16): Tolerance(
        atol=1e-4, rtol=2e-3,
        reason="as for bf16 with fp16's 2^-10 ulp: two ulps relative, atol for cancelling products.",
    ),
    ("rotary_bwd", torch.float32): Tolerance(
        atol=1e-6, rtol=1e-5,
        reason="backward is the forward kernel with the sine negated; autograd computes the same two "
               "products and add; as the forward, only FMA contraction on a GPU can differ.",
    ),
    ("rotary_bwd", torch.bfloat16): Tolerance(
        atol=1e-3, rtol=1.6e-2,
        reason="same numerics as rotary_fwd bf16 (one bf16 cast of an fp32 rotation).",
    ),
    ("rotary_bwd", torch.float16): Tolerance(
        atol=1e-4, rtol=2e-3,
        reason="same numerics as rotary_fwd fp16 (one fp16 cast of an fp32 rotation).",
    ),
    # ---- whole HF models patched by plait.inference_kernels.patching vs the same model unpatched.
    ("hf_patched_logits", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-5,
        reason="the reference ops repeat HF's fp32 arithmetic in HF's order (bitwise equal logits observed "
               "on CPU); the MLP's one GEMM on [W_gate; W_up] may block its reduction differently from "
               "two GEMMs, and the Triton path reduces RMSNorm in its own order: a few fp32 ulps per "
               "layer, well inside 1e-5 for O(1) logits of a 2-layer model.",
    ),
    ("hf_patched_logits", torch.bfloat16): Tolerance(
        atol=3e-2, rtol=3e-2,
        reason="HF rounds to bf16 after every element-wise step (x*rstd, weight*x, act(gate), *up, "
               "q*cos, ...) while plait computes each op in fp32 and rounds once, so the two bf16 models "
               "differ by a few bf16 ulps (2^-7) per op, compounded over 2 layers and the LM head. "
               "Observed <= 8e-3 on O(1) logits; 3e-2 leaves margin. The test also checks plait is no "
               "further from the fp32 model than HF's own bf16 forward.",
    ),
    # ---- plait-inference-kernels: fused_moe (Triton grouped GEMMs vs the torch reference, "_fwd";
    # the reference vs a float64 per-expert loop, "_reference"). Outputs are O(1) in the tests.
    ("fused_moe_fwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="fp32 GEMMs accumulated in a different order (K tiles of 32 vs torch's blocking) through "
               "two chained GEMMs and a k-way sum; observed 1e-6 absolute, up to 1.6e-4 relative only on "
               "outputs near zero, which atol covers.",
    ),
    ("fused_moe_fwd", torch.bfloat16): Tolerance(
        atol=2e-2, rtol=1.6e-2,
        reason="the paths round at different points: the reference rounds the gate/up GEMM to bf16 "
               "before the activation, the kernel activates its fp32 accumulators; both round the "
               "intermediate and each top-k partial output to bf16, the kernel after applying the routing "
               "weight. That is 2-3 bf16 ulps of an O(1) output (observed 2.3e-2 at |y| ~ 2).",
    ),
    ("fused_moe_fwd", torch.float16): Tolerance(
        atol=3e-3, rtol=2e-3,
        reason="same rounding points as bf16 with fp16's 2^-10 ulp; observed 1.95e-3 at |y| ~ 2 (one ulp).",
    ),
    ("fused_moe_reference", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="fp32 GEMMs against float64: accumulation rounding over K <= 64 terms, observed 1e-6.",
    ),
    ("fused_moe_reference", torch.bfloat16): Tolerance(
        atol=2e-2, rtol=1.6e-2,
        reason="bf16 inputs are exact in float64, but the reference rounds the gate/up output, the "
               "intermediate and the per-slot expert output to bf16 (three roundings of 2^-8 relative "
               "each, then an fp32 weighted sum and a final rounding); observed 1.4e-2 at |y| ~ 2.",
    ),
    ("fused_moe_reference", torch.float16): Tolerance(
        atol=3e-3, rtol=2e-3,
        reason="as for bf16 with fp16's 2^-10 ulp: three intermediate roundings; observed 1.8e-3.",
    ),
    # ---- paged_decode_attention: Triton online softmax vs the reference's SDPA on the gathered cache
    # ("_fwd"); the reference vs float64 dense attention per sequence ("_reference").
    ("paged_decode_attention_fwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-5,
        reason="online softmax (rescaled running max/sum over 16-64 token tiles, splits merged by "
               "log-sum-exp) vs a one-pass softmax: different fp32 summation orders; observed 6e-7.",
    ),
    ("paged_decode_attention_fwd", torch.bfloat16): Tolerance(
        atol=1e-2, rtol=1.6e-2,
        reason="the kernel rounds the softmax probabilities to bf16 for the P@V tensor-core dot (as flash "
               "attention does) while the reference keeps them in fp32; plus the final bf16 rounding: "
               "observed one bf16 ulp (7.8e-3 at |o| ~ 1-3).",
    ),
    ("paged_decode_attention_fwd", torch.float16): Tolerance(
        atol=1e-3, rtol=2e-3,
        reason="as for bf16 (probabilities rounded to fp16 for the P@V dot) with fp16's 2^-10 ulp; "
               "observed 9.8e-4 at |o| ~ 2.",
    ),
    ("paged_decode_attention_reference", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-5,
        reason="fp32 softmax and matmuls against float64 over <= 64 tokens; observed 5e-7.",
    ),
    ("paged_decode_attention_reference", torch.bfloat16): Tolerance(
        atol=1e-2, rtol=8e-3,
        reason="inputs are exact in float64 and the reference computes in fp32, so the only error is the "
               "final bf16 rounding (half an ulp, 2^-8 relative); observed 4e-3 at |o| ~ 2.",
    ),
    ("paged_decode_attention_reference", torch.float16): Tolerance(
        atol=1e-3, rtol=1e-3,
        reason="fp32 compute, one final fp16 rounding (half an ulp, 2^-11 relative); observed 4.9e-4.",
    ),
    # ---- write_kv_rotary: Triton rotate-and-store vs rotate-then-index_copy; both also against a
    # float64 complex rotation in the tests.
    ("write_kv_rotary_fwd", torch.float32): Tolerance(
        atol=5e-5, rtol=1e-5,
        reason="kernel and reference agree to an ulp (x*c + swap(x)*s vs x*c - x'*s, FMA contraction on a "
               "GPU); against float64 the fp32 cos/sin table itself is off by up to position * 2^-24 rad "
               "(position * inv_freq rounds in fp32), observed 1.3e-5 at position 300.",
    ),
    ("write_kv_rotary_fwd", torch.bfloat16): Tolerance(
        atol=1e-3, rtol=1.6e-2,
        reason="fp32 rotation and one bf16 cast on both sides; observed one bf16 ulp of difference (a "
               "few-ulp fp32 difference flips the final rounding), two allowed.",
    ),
    ("write_kv_rotary_fwd", torch.float16): Tolerance(
        atol=1e-3, rtol=2e-3,
        reason="fp32 rotation and one fp16 cast; against float64 the fp32 table error plus one fp16 "
               "rounding, observed 1.3e-3 at |x| ~ 3.",
    ),
    # ---- topk_routing: Triton softmax + top-k rounds + renormalisation vs torch softmax/topk.
    # Weights are fp32 whatever the logits' dtype (logits are upcast exactly), so one reason fits all.
    ("topk_routing_fwd", torch.float32): Tolerance(
        atol=1e-6, rtol=1e-5,
        reason="both take an fp32 softmax; the max and the row sum reduce in a different order and "
               "exp differs by an ulp between Triton/numpy and torch: a few fp32 ulps of each weight.",
    ),
    ("topk_routing_fwd", torch.bfloat16): Tolerance(
        atol=1e-6, rtol=1e-5,
        reason="bf16 logits are upcast exactly to fp32 first, so the numerics are those of the fp32 entry.",
    ),
    ("topk_routing_fwd", torch.float16): Tolerance(
        atol=1e-6, rtol=1e-5,
        reason="fp16 logits are upcast exactly to fp32 first, so the numerics are those of the fp32 entry.",
    ),
    # ---- plait.kernels.ops.moe_grouped: grouped_gated_mlp (padded batched GEMMs) vs its per-expert
    # loop reference, forward and gradients ("_fwd", "_bwd"); and plait-moe-layers' expert-parallel
    # layer vs one process ("moe_expert_parallel"). Outputs and gradients are O(0.1-1) in the tests.
    ("moe_grouped_fwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="torch.bmm and F.linear block the same fp32 dot products differently (K <= 64 terms); "
               "observed <= 1e-6 absolute.",
    ),
    ("moe_grouped_fwd", torch.bfloat16): Tolerance(
        atol=1.6e-2, rtol=1.6e-2,
        reason="both paths round the gate/up GEMM, the gated product and the down GEMM to bf16, but "
               "bmm and linear accumulate in different orders, so a rounding may land one bf16 ulp "
               "(2^-8 relative) apart at each of the three points.",
    ),
    ("moe_grouped_bwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="weight gradients sum over a segment's rows: bmm over the zero-padded buffer and linear "
               "over the segment add the same terms (plus exact zeros) in different orders.",
    ),
    # Triton grouped GEMMs (forward; backward: dx, dW_gate_up, dW_down) vs the torch reference: fp32
    # against float64, bf16 against the bf16 reference of the same precision.
    ("moe_grouped_triton_fwd", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="fp32 tiles of K=32 vs float64 through two chained GEMMs (K <= 80); observed <= 8.4e-7 "
               "absolute on O(2-4) outputs.",
    ),
    ("moe_grouped_triton_fwd", torch.bfloat16): Tolerance(
        atol=3e-2, rtol=1.6e-2,
        reason="both round gate/up, the product and the output to bf16, at points one ulp (2^-8) apart "
               "when the fp32 sums land on different sides of a rounding boundary; observed 4.7e-2 at "
               "|y| ~ 4.5 (1.5 ulp).",
    ),
    ("moe_grouped_triton_bwd", torch.float32): Tolerance(
        atol=1e-4, rtol=1e-4,
        reason="weight gradients sum over up to 21 rows of an expert and dx over 2I=80 terms, in tile "
               "order vs float64; observed <= 5.5e-6 on O(20) weight gradients.",
    ),
    ("moe_grouped_triton_bwd", torch.bfloat16): Tolerance(
        atol=6e-2, rtol=3e-2,
        reason="the kernels accumulate weight gradients over an expert's rows in fp32 and round once; the "
               "bf16 reference's GEMMs round d_act and d_gate_up first: a few bf16 ulps of O(1-5) "
               "gradients; observed 0.25 at |g| ~ 25 (2 ulps of 2^-3).",
    ),
    ("moe_expert_parallel", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="the expert-parallel layer runs each expert on rows received from every rank, grouped "
               "by source rank, and the router's gradient is summed over ranks by an all-reduce; one "
               "process adds the same fp32 terms in another order. Observed <= 1e-6.",
    ),
    # ---- quantize_blockwise / dequantize_blockwise (ZeRO++ communication): the dtype is that of the
    # compared floating tensor (fp32 scales, or the dequantized output). Integer codes are compared
    # with torch.equal. Zero on purpose: ranks must agree on the bits they send and rebuild.
    ("ulysses_attention", torch.float32): Tolerance(
        atol=2e-6, rtol=1e-5,
        reason="Ulysses moves q/k/v exactly (all-to-all copies); SDPA then runs on a [B, H/P, S, D] "
               "tensor instead of [B, H, S, D] (or on one unpadded sample for the padding oracle), so "
               "its matmuls may block and sum the head_dim/seq products in another order: a few fp32 ulps.",
    ),
    ("ulysses_model_grad", torch.float32): Tolerance(
        atol=1e-5, rtol=1e-4,
        reason="sequence-parallel vs single-process training of a whole model: parameter gradients are "
               "sums over tokens split across ranks and summed again by an all-reduce, the loss divides "
               "a sum of per-rank sums; fp32 reassociation over a few hundred tokens and 2 layers.",
    ),
    ("ulysses_model_grad", torch.bfloat16): Tolerance(
        atol=1.6e-2, rtol=1e-4,
        reason="compared on values divided by the reference tensor's largest magnitude, so atol carries it "
               "(rtol is fp32's, never tighter). With bf16 weights, or fp32 weights under bf16 autocast, the "
               "S/P-token partial sums of each weight gradient are "
               "rounded to bf16 on every rank before the all-reduce adds them, where the single process "
               "rounds one S-token sum, so elements differ by about one bf16 ulp (2^-7) of the tensor's "
               "scale; 2 ulps allowed, observed <= 0.0078 (Llama and Qwen3, bf16 weights and autocast, "
               "sp 2 and 4, padded batch).",
    ),
    ("tiled_recompute", torch.float32): Tolerance(
        atol=1e-6, rtol=1e-5,
        reason="tiling computes the same per-token values; only parameter-gradient sums (over tokens) are "
               "split per chunk and added after, and the loss is a sum of chunk sums: reduction order only.",
    ),
    ("tiled_recompute", torch.bfloat16): Tolerance(
        atol=1.6e-2, rtol=1e-5,
        reason="compared on values divided by the reference tensor's largest magnitude, so atol carries it "
               "(rtol is fp32's, never tighter). A bf16 head's weight gradient is a bf16 matmul per sequence "
               "chunk, summed in fp32 and rounded once more, where autograd rounds one matmul over every "
               "token: about one bf16 ulp (2^-7) of the tensor's scale; 2 ulps allowed, observed <= 0.0069 "
               "(seeds 0-3, with and without bias); hidden-state gradients mostly bitwise.",
    ),
    # ---- plait selftest: a ZeRO run on the device (world size 1) vs plain torch AdamW on the CPU.
    ("zero_losses_vs_cpu", torch.float32): Tolerance(
        atol=1e-6, rtol=1e-4,
        reason="fp32 on both sides (TF32 off), but the device's GEMMs and reductions block the sums "
               "differently from the CPU's BLAS: a few fp32 ulps per matmul, carried through 5 Adam "
               "steps at lr 1e-3 on an O(1) loss; 1e-4 relative leaves room for that and catches any "
               "lost or doubled gradient (which moves the loss by percent).",
    ),
    # ---- a model under torch.compile (inductor) vs the same model run eagerly.
    ("compiled_losses_vs_eager", torch.float32): Tolerance(
        atol=1e-6, rtol=1e-5,
        reason="inductor fuses the blocks' elementwise ops and reductions (RMSNorm's mean of squares, "
               "softmax, the loss) into its own loops, which sum in another order than eager's kernels: "
               "a few fp32 ulps per step, carried through the optimizer steps; observed 2.3e-7 relative "
               "(9.5e-7 absolute) on a loss near 4 by the third AdamW step of a 2-layer Llama under ZeRO "
               "at W=2. The aot_eager backend (no code generation) gives eager's losses bitwise.",
    ),
    # ---- ZeRO++ training losses against plain ZeRO on the same mesh (5 AdamW steps, lr 1e-2).
    ("zeropp_qwz_losses", torch.float32): Tolerance(
        atol=0.0, rtol=1.5e-2,
        reason="qwZ computes forward and backward with int8 weights (blockwise absmax, 256 per fp32 "
               "scale): each weight is off by up to half a 1/127 step of its block's largest magnitude, "
               "while the fp32 masters stay exact, so the loss moves by a fraction of a percent and does "
               "not drift; observed 5e-3 relative by the fifth step on the dp2 x tp2 transformer.",
    ),
    ("zeropp_qgz_losses", torch.float32): Tolerance(
        atol=0.0, rtol=5e-2,
        reason="qgZ sums int4 gradients (1/7 of a block's absmax per step) in its all-to-all: every "
               "update carries that error and AdamW's normalisation does not undo it, so it accumulates "
               "over steps; observed under 2e-2 relative by the fifth step on the dp2 x tp2 transformer "
               "(ZeRO++'s own tests stay within 3% of exact ZeRO).",
    ),
    ("quantize_blockwise", torch.float32): Tolerance(
        atol=0.0, rtol=0.0,
        reason="bitwise equal: absmax is a max (order-free), scale and codes use IEEE division "
               "(tl.div_rn / torch), dequantization is a single fp32 multiply (no FMA to contract).",
    ),
    ("quantize_blockwise", torch.bfloat16): Tolerance(
        atol=0.0, rtol=0.0,
        reason="bitwise equal: the kernel rounds fp32 -> bf16 by hand to nearest-even, as torch does "
               "(the CPU interpreter's own cast truncates, so it is not used for that rounding).",
    ),
    ("quantize_blockwise", torch.float16): Tolerance(
        atol=0.0, rtol=0.0,
        reason="bitwise equal: one fp32 -> fp16 round-to-nearest-even cast of identical fp32 values.",
    ),
    # ---- quant_matmul (weight-only int8/int4/fp6): y = x @ dequantize(W)^T. The reference
    # dequantizes to fp32 and does one fp32 matmul, cast once to x's dtype.
    ("quant_matmul_triton", torch.float32): Tolerance(
        atol=1e-4, rtol=1e-5,
        reason="the Triton kernel dequantizes in fp32 exactly as the reference does (same products of "
               "small integers and fp32 scales) and dots in fp32 without tf32, so only the summation "
               "order over K differs: a few fp32 ulps of the largest partial sum (K up to 2048 in the tests).",
    ),
    ("quant_matmul_triton", torch.bfloat16): Tolerance(
        atol=1e-4, rtol=1.6e-2,
        reason="both sides accumulate in fp32 and cast the output to bf16 once; a few-ulp fp32 difference "
               "(summation order) can flip that final rounding: one bf16 ulp (2^-7 relative), rtol allows two.",
    ),
    ("quant_matmul_triton", torch.float16): Tolerance(
        atol=1e-4, rtol=2e-3,
        reason="as for bf16: one flipped final fp16 rounding (2^-10 relative); rtol allows two ulps.",
    ),
    ("quant_matmul_avx2", torch.float32): Tolerance(
        atol=1e-4, rtol=1e-5,
        reason="plait's AVX2/AVX-512 kernels (quant_matmul_cpu) multiply fp32 activations by the reference's own "
               "dequantized int4 weights (the same single rounding of (q - z) * scale) and, for int8, by the "
               "codes with the channel scale applied to the sum; the sum runs in 16 lanes in another order. "
               "A few fp32 ulps of the largest partial sum (observed under 5e-7 relative, K 768).",
    ),
    ("quant_matmul_cpu", torch.float32): Tolerance(
        atol=1e-4, rtol=1e-5,
        reason="torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu dequantize with fp32 scales (and, "
               "int4, the float zero (8 - z) * scale, one extra fp32 rounding) and sum in another order; "
               "observed at most 1e-5 absolute on outputs up to 7 (K 2048).",
    ),
    ("quant_matmul_cpu", torch.bfloat16): Tolerance(
        atol=5e-2, rtol=1.6e-2,
        reason="torch's CPU kernels take the scales (and int4 zeros) in bf16, so every output channel's or "
               "group's scale is rounded to 8 significant bits (2^-9 relative), and the int4 kernel adds "
               "bf16-rounded terms; where the sum over K cancels, that error is absolute, not relative to y. "
               "Observed at most 0.031 absolute on outputs up to 8 (x ~ N(0,1), |w| ~ 0.05, K 2048).",
    ),
    ("quant_matmul_cpu", torch.float16): Tolerance(
        atol=1e-2, rtol=2e-3,
        reason="as for bf16 with fp16's 11 significant bits: observed at most 3.9e-3 absolute on outputs "
               "up to 8 (K 2048).",
    ),
}


def tolerance(op: str, dtype: torch.dtype) -> Tolerance:
    """Look up the tolerance for ``op`` at ``dtype``.

    Args:
        op: the op and pass, e.g. ``"rms_norm_fwd"``.
        dtype: the dtype of the op's inputs.

    Returns:
        The :class:`Tolerance` entry.

    Raises:
        KeyError: no entry for ``(op, dtype)``; the message names the pair, the dtypes the op
            does have, and tells the developer to add an entry with its reason.
    """
    try:
        return TOLERANCES[(op, dtype)]
    except KeyError:
        known = sorted(str(d).removeprefix("torch.") for (name, d) in TOLERANCES if name == op)
        have = f"it has entries for {', '.join(known)}" if known else "it has no entries at all"
        raise KeyError(
            f"no tolerance for ({op!r}, {dtype}) in plait.kernels.tolerances.TOLERANCES ({have}); "
            f"add an entry Tolerance(atol=..., rtol=..., reason=...) for it, with the reason the two "
            f"paths differ."
        ) from None
