"""Which CPU path each plait op should take inside vLLM: vLLM's own ``forward_cpu`` or plait's reference.

Times both on vLLM's CPU platform at decode and prefill sizes of small models, in fp32 and bf16,
and prints one table (median microseconds per call, and the ratio plait / vLLM). The winner per op
is what ``plait.vllm.ops.CPU_PATH`` records; the README has the figures.

    .venv-vllm/bin/python integrations/vllm/benchmarks/cpu_ops.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _median_us(fn, repeat: int) -> float:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _cases(dtype: torch.dtype, tokens: int, hidden: int, inter: int, head: int, heads: int):
    """(op, vLLM's forward_cpu, plait's) closures; plait's layers are built with PLAIT_VLLM_CPU_PATH=plait."""
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from plait.vllm import ops

    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype)
    res = torch.randn(tokens, hidden, dtype=dtype)
    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype)
    q = torch.randn(tokens, heads * head, dtype=dtype)
    k = torch.randn(tokens, heads * head, dtype=dtype)
    pos = torch.randint(0, 2048, (tokens,))
    os.environ["PLAIT_VLLM_CPU_PATH"] = "plait"  # read by plait's layers when they are built
    norm = RMSNorm(hidden, 1e-6, dtype=dtype)
    ours_norm = ops.PlaitRMSNorm(hidden, 1e-6, dtype=dtype)
    rope = RotaryEmbedding(head, head, 4096, 10000.0, True, dtype)
    ours_rope = ops.PlaitRotaryEmbedding(head, head, 4096, 10000.0, True, dtype)
    silu, ours_silu = SiluAndMul(), ops.PlaitSiluAndMul()
    gelu, ours_gelu = GeluAndMul(), ops.PlaitGeluAndMul()
    return [
        ("RMSNorm", lambda: norm.forward_cpu(x), lambda: ours_norm.forward_cpu(x)),
        ("RMSNorm+residual", lambda: norm.forward_cpu(x.clone(), res.clone()),
         lambda: ours_norm.forward_cpu(x.clone(), res.clone())),
        ("SiluAndMul", lambda: silu.forward_cpu(gate_up), lambda: ours_silu.forward_cpu(gate_up)),
        ("GeluAndMul", lambda: gelu.forward_cpu(gate_up), lambda: ours_gelu.forward_cpu(gate_up)),
        ("RotaryEmbedding", lambda: rope.forward_cpu(pos, q.clone(), k.clone()),
         lambda: ours_rope.forward_cpu(pos, q.clone(), k.clone())),
    ]


def _moe_cases(dtype: torch.dtype, tokens: int, hidden: int, inter: int, experts: int, top_k: int):
    """vLLM's portable CPU MoE kernel (``cpu_fused_moe`` over its prepacked "vec" layout, what
    ``CPUUnquantizedExperts`` runs) against plait's ``fused_experts_reference``."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    from plait.inference_kernels import fused_experts_reference

    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype) * 0.05
    w2 = torch.randn(experts, hidden, inter, dtype=dtype) * 0.05
    weights, ids = torch.randn(tokens, experts).softmax(-1).topk(top_k)
    ids = ids.to(torch.int32)
    packed13, packed2 = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")

    def theirs():
        out = torch.empty_like(x)
        cpu_fused_moe(out, x, packed13, packed2, None, None, weights, ids, "silu", "vec", False)
        return out

    return [("FusedMoE e8 top2", theirs, lambda: fused_experts_reference(x, w13, w2, weights, ids, "silu"))]


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    from vllm.config import VllmConfig, set_current_vllm_config

    print(f"torch threads {torch.get_num_threads()}, cores {os.cpu_count()}")
    print(f"{'op':18} {'dtype':9} {'tokens':>6} {'vllm us':>9} {'plait us':>9} {'plait/vllm':>10}")
    with set_current_vllm_config(VllmConfig()):
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in (1, 16, 512):
                cases = _cases(dtype, tokens, hidden=1024, inter=2816, head=64, heads=16)
                cases += _moe_cases(dtype, tokens, hidden=512, inter=1024, experts=8, top_k=2)
                for name, vllm_fn, plait_fn in cases:
                    t_vllm = _median_us(vllm_fn, args.repeat)
                    t_plait = _median_us(plait_fn, args.repeat)
                    print(f"{name:18} {str(dtype).removeprefix('torch.'):9} {tokens:>6} {t_vllm:>9.1f} "
                          f"{t_plait:>9.1f} {t_plait / t_vllm:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
