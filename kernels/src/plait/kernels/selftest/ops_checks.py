"""plait-kernels' selftest: every op in :mod:`plait.kernels.ops` against its torch reference at the
tolerance table's bound (forward and backward, fp32/bf16/fp16, Llama-8B-like and odd shapes), and
each memory-bound op's bandwidth as a share of ``copy_``'s.

On a GPU the public op runs its Triton kernel (CUDA tensors pick Triton); on the dry run the CLI
sets ``PLAIT_KERNEL_BACKEND=triton`` and ``TRITON_INTERPRET=1`` (when Triton imports), so the same
kernels run in the interpreter on tiny shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from plait.kernels import dispatch
from plait.kernels.ops import (
    QuantScheme,
    combine_rows,
    combine_rows_reference,
    dequantize_blockwise,
    dequantize_blockwise_reference,
    gated_activation_reference,
    gelu_and_mul,
    grouped_gated_mlp,
    grouped_gated_mlp_reference,
    pack_signs,
    permute_tokens,
    permute_tokens_reference,
    quant_matmul,
    quant_matmul_reference,
    quantize_blockwise,
    quantize_blockwise_reference,
    quantize_weight,
    rms_norm,
    rms_norm_reference,
    rotary_cos_sin,
    rotary_embedding,
    signs_reference,
    silu_and_mul,
    unpack_signs,
)
from plait.kernels.ops.quant_matmul import weight_nbytes
from plait.kernels.ops.rotary import split_cos_sin
from plait.kernels.selftest.core import Check, Outcome, SelftestContext, Skip
from plait.kernels.selftest.measure import accuracy_outcome, bandwidth_outcome, error_ratio

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _backend_note(ctx: SelftestContext) -> str:
    """Which path the fast side took; without Triton the dry run compares the reference with itself."""
    probe = torch.empty(1, device=ctx.device)
    backend = dispatch.select_backend(probe)
    if backend != dispatch.TRITON:
        raise Skip("Triton is not importable here: the op would run its torch reference against itself")
    return "Triton interpreter" if ctx.device.type == "cpu" else "Triton"


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple | list) else (out,)) if isinstance(t, torch.Tensor)]


def fwd_bwd_ratios(fast: Callable, ref: Callable, inputs: Sequence[torch.Tensor], op: str, dtype: torch.dtype,
                   label: str, ratios: dict[str, float], *, backward: bool = True) -> None:
    """Run ``fast`` and ``ref`` on copies of ``inputs``, forward and (optionally) backward, and record
    each output's and input gradient's error ratio against ``op``'s ``_fwd``/``_bwd`` tolerance.

    Args:
        fast: the public op (Triton on CUDA).
        ref: the torch reference with the same signature.
        inputs: the floating-point inputs (those that take gradients).
        op: the tolerance key's stem, e.g. ``"rms_norm"``.
        dtype: the inputs' dtype.
        label: the case's name for the row's note.
        ratios: where ``label -> ratio`` entries are added.
        backward: whether to compare gradients too.
    """
    fast_in = [t.detach().clone().requires_grad_(backward) for t in inputs]
    ref_in = [t.detach().clone().requires_grad_(backward) for t in inputs]
    fast_out, ref_out = _tensors(fast(*fast_in)), _tensors(ref(*ref_in))
    for i, (a, e) in enumerate(zip(fast_out, ref_out, strict=True)):
        ratios[f"{label} fwd out{i}"] = error_ratio(a, e, f"{op}_fwd", dtype)
    if not backward:
        return
    grads = [torch.randn_like(e) for e in ref_out]
    torch.autograd.backward(fast_out, grads)
    torch.autograd.backward(ref_out, grads)
    for i, (a, e) in enumerate(zip(fast_in, ref_in, strict=True)):
        ratios[f"{label} bwd d{i}"] = error_ratio(a.grad, e.grad, f"{op}_bwd", dtype)


def check_rms_norm(ctx: SelftestContext) -> Outcome:
    """RMSNorm (plain and with residual) on hidden 4096 and an odd width."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    for dtype in DTYPES:
        shapes = ctx.pick([(2048, 4096, False), (257, 5003, True)], [(4, 64, False), (3, 33, True)])
        for rows, hidden, residual in shapes:
            ctx.deadline.check(f"rms_norm {_NAMES[dtype]} {rows}x{hidden}")
            x = torch.randn(rows, hidden, device=ctx.device, dtype=dtype)
            w = (1 + 0.1 * torch.randn(hidden, device=ctx.device)).to(dtype)
            inputs = [x, w] + ([torch.randn_like(x)] if residual else [])
            if residual:
                def fast(a, b, r): return rms_norm(a, b, 1e-6, residual=r)
                def ref(a, b, r): return rms_norm_reference(a, b, 1e-6, residual=r)
            else:
                def fast(a, b): return rms_norm(a, b, 1e-6)
                def ref(a, b): return rms_norm_reference(a, b, 1e-6)
            fwd_bwd_ratios(fast, ref, inputs, "rms_norm", dtype,
                           f"{_NAMES[dtype]} {rows}x{hidden}{' +res' if residual else ''}", ratios)
    return accuracy_outcome(ratios, note)


def check_gated_activation(ctx: SelftestContext) -> Outcome:
    """SwiGLU (``silu_and_mul``) and GeGLU (``gelu_and_mul``, erf and tanh) on intermediate 14336."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    cases = (("silu", silu_and_mul), ("gelu", gelu_and_mul), ("gelu_tanh", lambda x: gelu_and_mul(x, "tanh")))
    for dtype in DTYPES:
        for rows, inter in ctx.pick([(1024, 14336), (77, 1001)], [(4, 48), (3, 37)]):
            x = torch.randn(rows, 2 * inter, device=ctx.device, dtype=dtype)
            for act, fast in cases:
                ctx.deadline.check(f"{act} {_NAMES[dtype]}")
                fwd_bwd_ratios(fast, lambda t, a=act: gated_activation_reference(t, a), [x], "gated_activation",
                               dtype, f"{act} {_NAMES[dtype]} {rows}x2*{inter}", ratios)
    return accuracy_outcome(ratios, note)


def check_rotary(ctx: SelftestContext) -> Outcome:
    """Differentiable RoPE (NeoX and GPT-J pairing) on Llama-8B heads (32 q / 8 kv of 128) and a partial one."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    # the dry run keeps the odd case (partial rotary, GQA): the interpreter's time is the CI budget's
    shapes = ctx.pick([(2048, 32, 8, 128, 128), (131, 5, 3, 96, 64)], [(3, 3, 1, 12, 8)])
    for dtype in DTYPES:
        for tokens, qh, kh, head, rot in shapes:
            table = rotary_cos_sin(4096, rot, device=ctx.device)
            positions = torch.randint(0, 4096, (tokens,), device=ctx.device)
            cos, sin = split_cos_sin(table, rot, ctx.device)
            for neox in (True, False):
                ctx.deadline.check(f"rotary {_NAMES[dtype]} {tokens}")
                q = torch.randn(tokens, qh * head, device=ctx.device, dtype=dtype)
                k = torch.randn(tokens, kh * head, device=ctx.device, dtype=dtype)

                fast = functools.partial(_rotary_fast, table=table, positions=positions, head=head, rot=rot,
                                         neox=neox)
                ref = functools.partial(_rotary_reference, cos=cos, sin=sin, positions=positions, head=head,
                                        rot=rot, neox=neox)
                label = f"{_NAMES[dtype]} {tokens}x{qh}/{kh}x{head} rot{rot} {'neox' if neox else 'gptj'}"
                fwd_bwd_ratios(fast, ref, [q, k], "rotary", dtype, label, ratios)
    return accuracy_outcome(ratios, note)


def _rotary_fast(q, k, *, table, positions, head, rot, neox):
    return rotary_embedding(q, k, table, positions, head_size=head, rotary_dim=rot, is_neox=neox)


def _rotary_reference(q, k, *, cos, sin, positions, head, rot, neox):
    from plait.kernels.ops.rotary import rotate_reference

    c, s = cos[positions], sin[positions]
    out = []
    for x in (q, k):
        heads = x.reshape(x.shape[0], -1, head)
        out.append(rotate_reference(heads, c, s, rot, neox).reshape(x.shape))
    return tuple(out)


def check_quantize(ctx: SelftestContext) -> Outcome:
    """Blockwise int8 / packed int4 quantize and dequantize: bitwise equal to the reference."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    for dtype in DTYPES:
        for numel in ctx.pick([4096 * 14336, 1_000_003], [1000, 257]):
            x = torch.randn(numel, device=ctx.device, dtype=dtype)
            for bits in (8, 4):
                ctx.deadline.check(f"quantize {bits}-bit {_NAMES[dtype]}")
                codes, scales = quantize_blockwise(x, bits=bits, block_size=256)
                ref_codes, ref_scales = quantize_blockwise_reference(x, bits=bits, block_size=256)
                label = f"{bits}-bit {_NAMES[dtype]} n={numel}"
                ratios[f"{label} codes"] = 0.0 if torch.equal(codes, ref_codes) else float("inf")
                ratios[f"{label} scales"] = error_ratio(scales, ref_scales, "quantize_blockwise", dtype)
                out = dequantize_blockwise(codes, scales, bits=bits, block_size=256, numel=numel, dtype=dtype)
                ref = dequantize_blockwise_reference(ref_codes, ref_scales, bits=bits, block_size=256, numel=numel,
                                                     dtype=dtype)
                ratios[f"{label} dequant"] = error_ratio(out, ref, "quantize_blockwise", dtype)
    return accuracy_outcome(ratios, note)


_QUANT_SCHEMES = (QuantScheme(kind="int8"), QuantScheme(kind="int4", group_size=64),
                  QuantScheme(kind="int4", group_size=128, symmetric=False), QuantScheme(kind="fp6"))


def _scheme_name(scheme: QuantScheme) -> str:
    if scheme.kind != "int4":
        return scheme.kind
    return f"int4 g{scheme.group_size}{'' if scheme.symmetric else ' asym'}"


def check_quant_matmul(ctx: SelftestContext) -> Outcome:
    """Weight-only int8 / int4 / FP6 matmul (inference only: forward) against the reference, on a
    decode batch and a prefill-sized one of Llama-8B's MLP shape and an odd output width."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    shapes = ctx.pick([(1, 14336, 4096), (512, 14336, 4096), (7, 1000, 4096)], [(1, 33, 128), (5, 16, 256)])
    for dtype in DTYPES:
        for rows, n, k in shapes:
            weight = torch.randn(n, k, device=ctx.device, dtype=dtype) / k ** 0.5
            x = torch.randn(rows, k, device=ctx.device, dtype=dtype)
            for scheme in _QUANT_SCHEMES:
                ctx.deadline.check(f"quant_matmul {_scheme_name(scheme)} {_NAMES[dtype]} {rows}x{n}x{k}")
                codes, scales, zeros = quantize_weight(weight, scheme)
                with torch.no_grad():
                    out = quant_matmul(x, codes, scales, zeros, scheme)
                    ref = quant_matmul_reference(x, codes, scales, zeros, scheme)
                label = f"{_scheme_name(scheme)} {_NAMES[dtype]} {rows}x{n}x{k}"
                ratios[label] = error_ratio(out, ref, "quant_matmul_triton", dtype)
    return accuracy_outcome(ratios, note + "; forward only")


def check_sign(ctx: SelftestContext) -> Outcome:
    """1-bit sign pack/unpack: the unpacked signs equal the reference's exactly (odd sizes too)."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    for dtype in DTYPES:
        for numel in ctx.pick([4096 * 4096, 1_000_003], [1000, 13]):
            ctx.deadline.check(f"sign {_NAMES[dtype]} {numel}")
            x = torch.randn(numel, device=ctx.device, dtype=dtype)
            x[::7] = 0  # zero counts as positive: the edge a sign kernel gets wrong
            same = torch.equal(unpack_signs(pack_signs(x), numel), signs_reference(x))
            ratios[f"{_NAMES[dtype]} n={numel}"] = 0.0 if same else float("inf")
    return accuracy_outcome(ratios, note + "; exact")


def check_moe_permute(ctx: SelftestContext) -> Outcome:
    """MoE permute (gather, exact) and combine (weighted scatter-add; fp32 sums in any order)."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    for dtype in DTYPES:
        tokens, hidden, top_k = ctx.pick((4096, 4096, 2), (9, 40, 2))
        ctx.deadline.check(f"moe permute {_NAMES[dtype]}")
        x = torch.randn(tokens, hidden, device=ctx.device, dtype=dtype)
        index = torch.randint(0, tokens, (tokens * top_k,), device=ctx.device)
        same = torch.equal(permute_tokens(x, index), permute_tokens_reference(x, index))
        ratios[f"permute {_NAMES[dtype]}"] = 0.0 if same else float("inf")
        rows = torch.randn(tokens * top_k, hidden, device=ctx.device, dtype=dtype)
        weights = torch.rand(tokens * top_k, device=ctx.device)
        got = combine_rows(rows, index, weights, tokens).float()
        want = combine_rows_reference(rows, index, weights, tokens).float()
        # Both sum in fp32 and round once to the output dtype; a different summation order may flip that
        # rounding by one ulp of the output dtype, hence the bound below (no table entry for this op).
        ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
        worst = float(((got - want).abs() / (1e-6 + 2 * ulp * want.abs())).max())
        ratios[f"combine {_NAMES[dtype]}"] = worst
    return accuracy_outcome(ratios, note + f"; T={tokens} H={hidden} top{top_k}; combine bound 2 output ulps")


def check_grouped_mlp(ctx: SelftestContext) -> Outcome:
    """The grouped gated MLP (MoE experts' GEMMs) vs its per-expert reference, fp32 (vs float64) and bf16."""
    note = _backend_note(ctx)
    ratios: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for experts, hidden, inter, rows in ctx.pick([(8, 4096, 14336, 512), (5, 1000, 1500, 77)],
                                                      [(3, 24, 20, 7)]):
            ctx.deadline.check(f"grouped mlp {_NAMES[dtype]}")
            counts = torch.distributions.Multinomial(rows, torch.ones(experts)).sample().long().to(ctx.device)
            x = torch.randn(rows, hidden, device=ctx.device, dtype=dtype)
            wgu = (torch.randn(experts, 2 * inter, hidden, device=ctx.device) / hidden**0.5).to(dtype)
            wd = (torch.randn(experts, hidden, inter, device=ctx.device) / inter**0.5).to(dtype)
            ref_dtype = torch.float64 if dtype == torch.float32 else dtype

            def fast(a, b, c, counts=counts): return grouped_gated_mlp(a, counts, b, c)

            def ref(a, b, c, counts=counts, ref_dtype=ref_dtype):
                out = grouped_gated_mlp_reference(a.to(ref_dtype), counts, b.to(ref_dtype), c.to(ref_dtype))
                return out.to(a.dtype)
            fwd_bwd_ratios(fast, ref, [x, wgu, wd], "moe_grouped_triton", dtype,
                           f"{_NAMES[dtype]} E{experts} H{hidden} I{inter} N{rows}", ratios)
    return accuracy_outcome(ratios, note + "; fp16 has no tolerance entry (not a supported grouped-GEMM dtype)")


def _bw_rms_norm(ctx: SelftestContext) -> Outcome:
    _backend_note(ctx)
    rows, hidden = ctx.pick((16384, 4096), (64, 64))
    x = torch.randn(rows, hidden, device=ctx.device, dtype=torch.bfloat16)
    w = torch.ones(hidden, device=ctx.device, dtype=torch.bfloat16)
    with torch.no_grad():
        return bandwidth_outcome(lambda: rms_norm(x, w), 2 * x.numel() * 2, ctx, note=f"bf16 {rows}x{hidden} fwd")


def _bw_silu(ctx: SelftestContext) -> Outcome:
    _backend_note(ctx)
    rows, inter = ctx.pick((8192, 14336), (32, 48))
    x = torch.randn(rows, 2 * inter, device=ctx.device, dtype=torch.bfloat16)
    with torch.no_grad():
        return bandwidth_outcome(lambda: silu_and_mul(x), 3 * rows * inter * 2, ctx, note=f"bf16 {rows}x2*{inter} fwd")


def _bw_quantize(ctx: SelftestContext) -> Outcome:
    _backend_note(ctx)
    numel = ctx.pick(256 * 2**20, 4096)
    x = torch.randn(numel, device=ctx.device, dtype=torch.float32)
    moved = 4 * numel + numel + 4 * (numel // 256)
    return bandwidth_outcome(lambda: quantize_blockwise(x, bits=8), moved, ctx, note=f"fp32 n={numel} int8")


def _bw_quant_matmul(ctx: SelftestContext) -> Outcome:
    """Decode (one row) is bound by reading the int4 weight: its bytes set the traffic."""
    _backend_note(ctx)
    n, k = ctx.pick((14336, 4096), (32, 128))
    scheme = QuantScheme(kind="int4", group_size=64)
    codes, scales, zeros = quantize_weight(torch.randn(n, k, device=ctx.device, dtype=torch.bfloat16), scheme)
    x = torch.randn(1, k, device=ctx.device, dtype=torch.bfloat16)
    moved = weight_nbytes((n, k), scheme) + 2 * (k + n)
    with torch.no_grad():
        return bandwidth_outcome(lambda: quant_matmul(x, codes, scales, zeros, scheme), moved, ctx,
                                 note=f"int4 g64 bf16 decode 1x{n}x{k}")


def _bw_sign(ctx: SelftestContext) -> Outcome:
    _backend_note(ctx)
    numel = ctx.pick(256 * 2**20, 4096)
    x = torch.randn(numel, device=ctx.device, dtype=torch.float32)
    return bandwidth_outcome(lambda: pack_signs(x), 4 * numel + numel // 8, ctx, note=f"fp32 n={numel} pack")


def checks(ctx: SelftestContext) -> list[Check]:
    """plait-kernels' checks (the ``plait.selftest`` entry point ``kernels``)."""
    del ctx  # the same checks everywhere; each picks its shapes from the context
    return [
        Check("kernels/rms_norm", check_rms_norm, 60),
        Check("kernels/gated_activation", check_gated_activation, 90),
        Check("kernels/rotary", check_rotary, 60),
        Check("kernels/quantize", check_quantize, 40),
        Check("kernels/sign_pack", check_sign, 20),
        Check("kernels/quant_matmul", check_quant_matmul, 60),
        Check("kernels/moe_permute", check_moe_permute, 30),
        Check("kernels/grouped_mlp", check_grouped_mlp, 90),
        Check("kernels/bw rms_norm", _bw_rms_norm, 20),
        Check("kernels/bw silu_and_mul", _bw_silu, 20),
        Check("kernels/bw quantize", _bw_quantize, 20),
        Check("kernels/bw sign_pack", _bw_sign, 20),
        Check("kernels/bw quant_matmul", _bw_quant_matmul, 20),
    ]
