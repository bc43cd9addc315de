"""``plait bench inference-kernels``: the package's benchmark suite.

On any machine: the reference (CPU) path of each op against the installed transformers' own code
(:mod:`~plait.inference_kernels.benchmarks.hf_peers`: its ``MixtralSparseMoeBlock`` with the eager
and the ``grouped_mm`` experts, its ``sdpa_attention_forward`` on the gathered cache, its Llama
``apply_rotary_pos_emb``), fp32, one thread, interleaved A B C ... in one run, after checking every
side gives the same output. Target: no slower (ratio <= 1.0). The MoE rows also keep plait's own
torch copy of the older HF Mixtral loop (:class:`~plait.inference_kernels.benchmarks.peers.EagerMixtralMoE`,
separate ``w1``/``w3``/``w2`` linears per expert), labelled as such and without a target. Without
transformers the transformers rows say so (peer n/a) instead of timing anything.

With CUDA: additionally :func:`~plait.inference_kernels.benchmarks.gpu.gpu_rows` - each op's
Triton path in bf16 against torch eager, torch.compile and Liger-Kernel, as fractions of the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from plait.inference_kernels.benchmarks import hf_peers
from plait.inference_kernels.benchmarks.peers import EagerMixtralMoE
from plait.inference_kernels.moe.fused_moe import fused_moe
from plait.inference_kernels.paged_attention import paged_decode_attention
from plait.inference_kernels.paged_attention_kv_write import write_kv_rotary
from plait.inference_kernels.patching import benchmark as patching_benchmark
from plait.kernels.bench import BenchRow, interleaved_timing, one_thread, timing_row
from plait.kernels.tolerances import tolerance

# The shared benchmark model's MoE variant (tiny-llama: hidden 256, SwiGLU 688, 8 experts, top-2).
MOE_SHAPE = {"hidden": 256, "intermediate": 688, "experts": 8, "top_k": 2}


def _checked_row(name, ours_fn, peer_fn, peer_name, tol_key, *, steps):
    """Check ours and the peer agree, then time them interleaved; a mismatch fails the row."""
    with torch.no_grad():
        ours_out, peer_out = ours_fn(), peer_fn()
    try:
        tolerance(tol_key, torch.float32).assert_close(ours_out, peer_out, what=name)
    except AssertionError as exc:
        first_line = str(exc).splitlines()[0]
        return BenchRow(benchmark=name, figure="time (ms)", ours=float("nan"), peer=peer_name,
                        passed=False, note=f"outputs differ: {first_line}")
    with torch.no_grad():
        stats = interleaved_timing({"ours": ours_fn, "peer": peer_fn}, warmup=3, steps=steps)
    return timing_row(name, stats["ours"], peer_name, stats["peer"], target_ratio=1.0)


def _checked_rows(name, ours_fn, peers, *, steps):
    """Like :func:`_checked_row` for several peers timed in one interleaved run (A B C A B C ...).

    Args:
        peers: label -> (callable, tolerance key, target ratio or None).
    """
    with torch.no_grad():
        ours_out = ours_fn()
    rows, timed = [], {}
    for label, (fn, tol_key, _) in peers.items():
        with torch.no_grad():
            peer_out = fn()
        try:
            tolerance(tol_key, torch.float32).assert_close(ours_out, peer_out, what=f"{name} vs {label}")
        except AssertionError as exc:
            rows.append(BenchRow(benchmark=name, figure="time (ms)", ours=float("nan"), peer=label, passed=False,
                                 note=f"outputs differ: {str(exc).splitlines()[0]}"))
            continue
        timed[label] = fn
    with torch.no_grad():
        stats = interleaved_timing({"ours": ours_fn, **timed}, warmup=3, steps=steps)
    for label in timed:
        rows.append(timing_row(name, stats["ours"], label, stats[label], target_ratio=peers[label][2]))
    return rows


def _no_transformers_row(name: str, peer: str) -> BenchRow:
    return BenchRow(benchmark=name, figure="time (ms)", ours=float("nan"), peer=peer,
                    note="transformers not installed: pip install 'plait-inference-kernels[hf]'")


HF_MOE = "transformers MixtralSparseMoeBlock, {} experts"
OWN_MOE = "plait's torch copy of the older HF Mixtral loop (w1/w3/w2 per expert; not transformers)"


def moe_rows(quick: bool, *, steps: int) -> list[BenchRow]:
    """fused_moe (reference path) against transformers' Mixtral sparse-MoE block, fp32 CPU."""
    rows = []
    s = MOE_SHAPE
    have_hf = hf_peers.transformers_version() is not None
    torch.manual_seed(0)
    own = EagerMixtralMoE(s["hidden"], s["intermediate"], s["experts"], s["top_k"])
    if have_hf:  # the same weights everywhere: transformers' block holds them in plait's fused layout
        blocks = {impl: hf_peers.mixtral_block(s["hidden"], s["intermediate"], s["experts"], s["top_k"],
                                               experts_implementation=impl) for impl in ("eager", "grouped_mm")}
        ref = blocks["eager"]
        for block in blocks.values():
            block.load_state_dict(ref.state_dict())
        w_gate_up, w_down = ref.experts.gate_up_proj.detach(), ref.experts.down_proj.detach()
        with torch.no_grad():
            own.gate.weight.copy_(ref.gate.weight)
            for e in range(s["experts"]):
                own.w1[e].weight.copy_(w_gate_up[e, :s["intermediate"]])
                own.w3[e].weight.copy_(w_gate_up[e, s["intermediate"]:])
                own.w2[e].weight.copy_(w_down[e])
    else:
        w_gate_up, w_down = own.stacked_weights()
    for tokens in (16, 512) if quick else (1, 16, 128, 512, 2048):
        x = torch.randn(tokens, s["hidden"])
        name = f"fused_moe ref T={tokens} H={s['hidden']} E={s['experts']} k={s['top_k']} fp32"

        def ours(x=x):
            return fused_moe(x, w_gate_up, w_down, own.gate(x), top_k=s["top_k"])

        peers = {}
        if have_hf:
            for impl, block in blocks.items():
                peers[HF_MOE.format(impl)] = (lambda x=x, b=block: b(x[None])[0], "fused_moe_reference", 1.0)
        else:
            rows += [_no_transformers_row(name, HF_MOE.format(impl)) for impl in ("eager", "grouped_mm")]
        peers[OWN_MOE] = (lambda x=x: own(x), "fused_moe_reference", None)
        rows += _checked_rows(name, ours, peers, steps=steps)
    return rows


def _paged_case(batch, context, q_heads, kv_heads, head_dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = math.ceil(context / block_size)
    num_blocks = batch * max_blocks
    q = torch.randn(batch, q_heads, head_dim, generator=gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, max_blocks).int()
    # Lengths spread over (context/2, context]: a batch of sequences of different ages.
    seq_lens = torch.randint(context // 2 + 1, context + 1, (batch,), generator=gen).int()
    return q, k_cache, v_cache, tables, seq_lens


HF_SDPA = "transformers sdpa_attention_forward (repeat_kv) on the gathered cache"
HF_ROTARY = "transformers apply_rotary_pos_emb + index_copy_"


def paged_rows(quick: bool, *, steps: int) -> list[BenchRow]:
    """paged_decode_attention (reference path) against transformers' SDPA on the gathered cache, fp32 CPU."""
    rows = []
    configs = [(8, 512, 8, 2, 64, 16)] if quick else [(8, 512, 8, 2, 64, 16), (8, 2048, 8, 2, 64, 16),
                                                      (8, 1024, 4, 4, 64, 16)]
    for batch, context, q_heads, kv_heads, head_dim, block_size in configs:
        args = _paged_case(batch, context, q_heads, kv_heads, head_dim, block_size)
        scale = 1 / math.sqrt(head_dim)
        name = f"paged_decode ref B={batch} ctx<={context} Hq={q_heads} Hkv={kv_heads} D={head_dim} fp32"
        if hf_peers.transformers_version() is None:
            rows.append(_no_transformers_row(name, HF_SDPA))
            continue
        rows.append(_checked_row(name, lambda a=args, s=scale: paged_decode_attention(*a, scale=s),
                                 lambda a=args, s=scale: hf_peers.sdpa_on_gathered_cache(*a, s),
                                 HF_SDPA, "paged_decode_attention_reference", steps=steps))
    return rows


def kv_write_rows(quick: bool, *, steps: int) -> list[BenchRow]:
    """write_kv_rotary (reference path) against transformers' apply_rotary_pos_emb + index_copy_, fp32 CPU."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    kv_heads, q_heads, head_dim, block_size = 2, 8, 64, 16
    for tokens in (64,) if quick else (64, 1024):
        num_blocks = 2 * tokens // block_size + 4
        k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        q = torch.randn(tokens, q_heads, head_dim, generator=gen)
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.arange(4096).float()[:, None] * inv_freq
        table = torch.cat((angles.cos(), angles.sin()), dim=-1)
        caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim) for _ in range(4)]

        def ours(c=caches, k=k, v=v, q=q, p=positions, s=slots, t=table):
            return write_kv_rotary(k, v, p, t, c[0], c[1], s, q=q)

        def peer(c=caches, k=k, v=v, q=q, p=positions, s=slots, t=table):
            return hf_peers.rotary_then_cache_write(k, v, p, t, c[2], c[3], s, q)

        name = f"write_kv_rotary ref T={tokens} Hkv={kv_heads} Hq={q_heads} D={head_dim} fp32"
        if hf_peers.transformers_version() is None:
            rows.append(_no_transformers_row(name, HF_ROTARY))
            continue
        rows.append(_checked_row(name, ours, peer, HF_ROTARY, "write_kv_rotary_fwd", steps=steps))
    return rows


def run(quick: bool) -> list[BenchRow]:
    """Run the suite: CPU reference rows everywhere, GPU rows when CUDA is available.

    Args:
        quick: small sizes (under a minute on 2 CPU cores).

    Returns:
        The table's rows.
    """
    steps = 15 if quick else 30  # medians of more steps: the shared CPU machines are noisy
    with one_thread():
        rows = moe_rows(quick, steps=steps) + paged_rows(quick, steps=steps) + kv_write_rows(quick, steps=steps)
    if importlib.util.find_spec("transformers") is not None:  # the patched-HF-model rows need it
        rows += patching_benchmark.run(quick)
    else:
        print("inference-kernels: transformers not installed; HF patching rows skipped "
              "(pip install 'plait-inference-kernels[hf]')")
    if torch.cuda.is_available():
        from plait.inference_kernels.benchmarks.gpu import gpu_rows

        rows += gpu_rows(quick)
    return rows
