"""plait-inference-kernels' checks for ``plait selftest``: paged decode attention, the fused KV write
with RoPE, top-k routing and fused MoE against their torch references at the tolerance table's
bound; decode attention's bandwidth as a share of ``copy_``'s; and the HF patching of a random
Llama (1B-shaped on a GPU) and Qwen3-MoE: greedy tokens equal to unpatched HF, and prefill/decode
time against it, and against Liger-Kernel where it imports (a GPU run only; a SKIP with the
reason elsewhere).
"""

from __future__ import annotations

import copy
import importlib.util

import torch

from plait.inference_kernels.moe import fused_experts, fused_experts_reference, topk_routing, topk_routing_reference
from plait.inference_kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from plait.inference_kernels.paged_attention_kv_write import write_kv_rotary, write_kv_rotary_reference
from plait.kernels.ops import rotary_cos_sin
from plait.kernels.selftest.core import FAIL, PASS, Check, Outcome, SelftestContext, Skip
from plait.kernels.selftest.measure import accuracy_outcome, bandwidth_outcome, device_seconds, error_ratio
from plait.kernels.selftest.ops_checks import DTYPES, _backend_note

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _paged_inputs(ctx, dtype, batch, q_heads, kv_heads, head, max_ctx, block):
    blocks_per_seq = -(-max_ctx // block)
    num_blocks = batch * blocks_per_seq + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, head, device=ctx.device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 3, device=ctx.device)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    seq_lens = torch.randint(1, max_ctx + 1, (batch,), device=ctx.device)
    seq_lens[0] = max_ctx  # one full-length sequence, the rest odd lengths
    q = torch.randn(batch, q_heads, head, device=ctx.device, dtype=dtype)
    return q, k_cache, v_cache, tables.int(), seq_lens.int()


def check_paged_decode(ctx: SelftestContext) -> Outcome:
    """Paged decode attention (flash-decoding splits) on Llama-3-8B GQA heads."""
    note = _backend_note(ctx)
    ratios = {}
    for dtype in DTYPES:
        for batch, qh, kvh, head, max_ctx, block in ctx.pick([(8, 32, 8, 128, 4096, 16), (5, 28, 4, 64, 1031, 32)],
                                                               [(2, 4, 2, 32, 37, 8), (3, 2, 1, 64, 9, 4)]):
            ctx.deadline.check(f"paged decode {_NAMES[dtype]}")
            q, kc, vc, tables, lens = _paged_inputs(ctx, dtype, batch, qh, kvh, head, max_ctx, block)
            got = paged_decode_attention(q, kc, vc, tables, lens)
            want = paged_decode_attention_reference(q, kc, vc, tables, lens, head**-0.5)
            ratios[f"{_NAMES[dtype]} B{batch} {qh}/{kvh}x{head} ctx<={max_ctx} blk{block}"] = error_ratio(
                got, want, "paged_decode_attention_fwd", dtype)
    return accuracy_outcome(ratios, note)


def check_paged_decode_bandwidth(ctx: SelftestContext) -> Outcome:
    """Decode attention reads the whole KV cache once: its bandwidth as a share of copy_'s."""
    _backend_note(ctx)
    batch, qh, kvh, head, max_ctx, block = ctx.pick((64, 32, 8, 128, 2048, 16), (2, 4, 2, 32, 16, 8))
    q, kc, vc, tables, lens = _paged_inputs(ctx, torch.bfloat16, batch, qh, kvh, head, max_ctx, block)
    lens.fill_(max_ctx)
    moved = 2 * batch * max_ctx * kvh * head * 2 + 2 * q.numel() * 2
    return bandwidth_outcome(lambda: paged_decode_attention(q, kc, vc, tables, lens, check_bounds=False), moved, ctx,
                             note=f"bf16 B{batch} ctx{max_ctx} {qh}/{kvh}x{head}")


def check_write_kv_rotary(ctx: SelftestContext) -> Outcome:
    """The fused RoPE + paged KV-cache write (rotated q returned, k and v written to their slots)."""
    note = _backend_note(ctx)
    ratios = {}
    for dtype in DTYPES:
        tokens, qh, kvh, head, block = ctx.pick((8192, 32, 8, 128, 16), (7, 4, 2, 32, 4))
        ctx.deadline.check(f"write_kv_rotary {_NAMES[dtype]}")
        num_blocks = -(-tokens // block) + 2
        k = torch.randn(tokens, kvh, head, device=ctx.device, dtype=dtype)
        v, q = torch.randn_like(k), torch.randn(tokens, qh, head, device=ctx.device, dtype=dtype)
        positions = torch.randint(0, 4096, (tokens,), device=ctx.device)
        table = rotary_cos_sin(4096, head, device=ctx.device)
        slots = torch.randperm(num_blocks * block, device=ctx.device)[:tokens]
        slots[0] = -1  # a skipped slot
        caches = [torch.zeros(num_blocks, block, kvh, head, device=ctx.device, dtype=dtype) for _ in range(4)]
        got_q = write_kv_rotary(k, v, positions, table, caches[0], caches[1], slots, q=q)
        want_q = write_kv_rotary_reference(k, v, positions, table, caches[2], caches[3], slots, q=q)
        label = f"{_NAMES[dtype]} T{tokens} {qh}/{kvh}x{head}"
        ratios[f"{label} q"] = error_ratio(got_q, want_q, "write_kv_rotary_fwd", dtype)
        ratios[f"{label} k_cache"] = error_ratio(caches[0], caches[2], "write_kv_rotary_fwd", dtype)
        ratios[f"{label} v_cache"] = error_ratio(caches[1], caches[3], "write_kv_rotary_fwd", dtype)
    return accuracy_outcome(ratios, note)


def _same_picks(logits: torch.Tensor, ids: torch.Tensor, ref_ids: torch.Tensor) -> bool:
    """Whether two top-k routings pick the same experts, up to ties: random bf16 logits often round
    onto equal values, and where the k-th and (k+1)-th logits of a token are equal either expert is a
    correct pick (the kernel and ``torch.topk`` may break the tie differently). So the picked logits
    are compared, sorted per token, when the ids themselves differ."""
    if torch.equal(ids.long(), ref_ids.long()):
        return True
    got = logits.gather(1, ids.long()).float().sort(dim=1).values
    want = logits.gather(1, ref_ids.long()).float().sort(dim=1).values
    return torch.equal(got, want)


def check_fused_moe(ctx: SelftestContext) -> Outcome:
    """Top-k routing and the fused MoE experts on Mixtral-8x7B shapes (and odd ones)."""
    note = _backend_note(ctx)
    ratios = {}
    for dtype in DTYPES:
        for tokens, experts, hidden, inter, top_k in ctx.pick([(256, 8, 4096, 14336, 2), (37, 6, 1000, 1500, 3)],
                                                               [(9, 4, 32, 48, 2)]):
            ctx.deadline.check(f"fused_moe {_NAMES[dtype]} T{tokens}")
            label = f"{_NAMES[dtype]} T{tokens} E{experts} H{hidden} I{inter} top{top_k}"
            logits = torch.randn(tokens, experts, device=ctx.device, dtype=dtype)
            weights, ids = topk_routing(logits, top_k)
            ref_weights, ref_ids = topk_routing_reference(logits, top_k)
            ratios[f"{label} routing ids"] = 0.0 if _same_picks(logits, ids, ref_ids) else float("inf")
            ratios[f"{label} routing weights"] = error_ratio(weights, ref_weights, "topk_routing_fwd", dtype)
            x = torch.randn(tokens, hidden, device=ctx.device, dtype=dtype)
            w_gu = (torch.randn(experts, 2 * inter, hidden, device=ctx.device) / hidden**0.5).to(dtype)
            w_d = (torch.randn(experts, hidden, inter, device=ctx.device) / inter**0.5).to(dtype)
            got = fused_experts(x, w_gu, w_d, ref_weights, ref_ids)
            want = fused_experts_reference(x, w_gu, w_d, ref_weights, ref_ids)
            ratios[f"{label} experts"] = error_ratio(got, want, "fused_moe_fwd", dtype)
    return accuracy_outcome(ratios, note)


def _model(ctx: SelftestContext, family: str, dtype: torch.dtype):
    import transformers

    if family == "llama":  # Llama-3.2-1B's shape on a GPU
        config = transformers.LlamaConfig(**ctx.pick(
            dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, intermediate_size=8192),
            dict(vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96)), max_position_embeddings=4096)
    else:  # Qwen3-30B-A3B's layer shape, fewer layers (~2.4B parameters) on a GPU
        config = transformers.Qwen3MoeConfig(**ctx.pick(
            dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
                 num_experts_per_tok=8, moe_intermediate_size=768),
            dict(vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32)), max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), config


def _pair(ctx: SelftestContext, family: str, dtype: torch.dtype):
    """Unpatched HF and a patched copy of the same random weights, and the config."""
    from plait.inference_kernels.patching import PatchConfig, apply

    hf, config = _model(ctx, family, dtype)
    ours = copy.deepcopy(hf)
    apply(ours, PatchConfig(policy="always"))
    return hf, ours, config


def _hf_patching(ctx: SelftestContext, family: str) -> Outcome:
    """Greedy tokens of the patched model equal unpatched HF's (fp32); prefill/decode time (bf16 on a
    GPU, with a fresh pair: patching may cache fused weights in the dtype it saw first)."""
    _backend_note(ctx)
    if importlib.util.find_spec("transformers") is None:
        raise Skip("transformers is not installed")
    prompt, new = ctx.pick((512, 32), (6, 2))
    generate = dict(max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0)
    with torch.no_grad():
        hf, ours, config = _pair(ctx, family, torch.float32)
        params = sum(p.numel() for p in hf.parameters())
        ids = torch.randint(0, config.vocab_size, (1, prompt), device=ctx.device)
        tokens = {name: m.generate(ids, **generate)[0, prompt:] for name, m in (("plait", ours), ("hf", hf))}
        ctx.deadline.check("timing")
        timing_dtype = ctx.pick(torch.bfloat16, torch.float32)
        if timing_dtype != torch.float32:
            del hf, ours
            hf, ours, _ = _pair(ctx, family, timing_dtype)
        repeats, warmup = ctx.pick((5, 1), (1, 0))  # the dry run only exercises the timing code
        prefill = {n: device_seconds(lambda m=m: m(ids), ctx, repeats=repeats, warmup=warmup)
                   for n, m in (("plait", ours), ("hf", hf))}
        decode = {n: (device_seconds(lambda m=m: m.generate(ids, **generate), ctx, repeats=repeats, warmup=warmup)
                      - prefill[n]) / new for n, m in (("plait", ours), ("hf", hf))}
    same = torch.equal(tokens["plait"], tokens["hf"])
    first = int((tokens["plait"] != tokens["hf"]).nonzero()[0]) if not same else -1
    text = (f"{params / 1e6:.1f}M params, prompt {prompt}, {new} greedy tokens "
            f"{'equal' if same else f'differ from token {first}'} (fp32); prefill {prefill['plait'] * 1e3:.1f} vs "
            f"HF {prefill['hf'] * 1e3:.1f} ms, decode {decode['plait'] * 1e3:.2f} vs HF {decode['hf'] * 1e3:.2f} "
            f"ms/token ({_NAMES[timing_dtype]})")
    if ctx.dry_run:
        text = "dry run: times are not GPU figures; " + text
    return Outcome(PASS if same else FAIL, "HF prefill time / plait's", prefill["hf"] / prefill["plait"], "", text)


def _prefill_decode(model, ids: torch.Tensor, new: int, ctx: SelftestContext) -> tuple[float, float]:
    """Seconds of one prefill of ``ids``, and per generated token of a greedy ``new``-token decode."""
    generate = dict(max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0)
    repeats, warmup = ctx.pick((5, 1), (1, 0))
    prefill = device_seconds(lambda: model(ids), ctx, repeats=repeats, warmup=warmup)
    whole = device_seconds(lambda: model.generate(ids, **generate), ctx, repeats=repeats, warmup=warmup)
    return prefill, (whole - prefill) / new


def check_liger(ctx: SelftestContext) -> Outcome:
    """Liger-Kernel as a peer of the HF patching on the 1B-shaped Llama in bf16: prefill and decode
    time of Liger's patched model against plait's. Liger patches ``modeling_llama`` module-wide (its
    RoPE, RMSNorm and MLP classes), so plait is timed first and the module is restored afterwards."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("Liger-Kernel is not installed here (carry its wheel, docs/gpu.md); no peer timing")
    if ctx.dry_run:
        raise Skip("Liger-Kernel's kernels need a GPU; the peer timing runs on a GPU run only")
    if importlib.util.find_spec("transformers") is None:
        raise Skip("transformers is not installed")
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    prompt, new = 512, 32
    saved = {name: getattr(modeling_llama, name) for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    try:
        with torch.no_grad():
            hf, ours, config = _pair(ctx, "llama", torch.bfloat16)
            ids = torch.randint(0, config.vocab_size, (1, prompt), device=ctx.device)
            plait = _prefill_decode(ours, ids, new, ctx)
            del ours
            ctx.deadline.check("Liger timing")
            apply_liger_kernel_to_llama(model=hf, fused_linear_cross_entropy=False)
            liger = _prefill_decode(hf, ids, new, ctx)
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)
    note = (f"Llama-3.2-1B-shaped, bf16, prompt {prompt}: prefill plait {plait[0] * 1e3:.1f} vs Liger "
            f"{liger[0] * 1e3:.1f} ms, decode plait {plait[1] * 1e3:.2f} vs Liger {liger[1] * 1e3:.2f} ms/token")
    return Outcome(PASS, "Liger prefill time / plait's", liger[0] / plait[0], "", note)


def checks(ctx: SelftestContext) -> list[Check]:
    """plait-inference-kernels' checks (entry point ``plait.selftest`` ``inference-kernels``)."""
    del ctx
    return [
        Check("inference-kernels/paged_decode_attention", check_paged_decode, 60),
        Check("inference-kernels/bw paged_decode_attention", check_paged_decode_bandwidth, 20),
        Check("inference-kernels/write_kv_rotary", check_write_kv_rotary, 30),
        Check("inference-kernels/fused_moe", check_fused_moe, 90),
        Check("inference-kernels/hf llama", lambda c: _hf_patching(c, "llama"), 90),
        Check("inference-kernels/hf qwen3-moe", lambda c: _hf_patching(c, "qwen3_moe"), 120),
        Check("inference-kernels/liger peer", check_liger, 60),
    ]
