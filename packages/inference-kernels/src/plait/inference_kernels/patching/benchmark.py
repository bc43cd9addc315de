"""Benchmark of the HF patch on CPU: plait's reference ops and a patched model against HF eager.

``run(quick)`` follows the ``plait.benchmarks`` contract (a list of
:class:`plait.kernels.bench.BenchRow`). Everything is fp32 with one torch thread, and ours and
HF's code alternate in one run (A B A B, 3 warm-up rounds, median of at least 10). Before timing,
each row checks that both sides give the same output. Target for every row: no slower than HF
eager (ratio <= 1.0).

Rows:

* ``silu_and_mul``: the reference path against HF's ``act_fn(gate) * up`` on the same fused
  input, at tiny-llama's SwiGLU width (688).
* ``rotary``: ``apply_rotary`` (in place, reference path) against the family's own
  ``apply_rotary_pos_emb`` on HF's ``[b, h, s, d]`` q/k with GQA (4 q heads, 2 kv heads of 64).
* ``LlamaRMSNorm`` / ``LlamaMLP``: one decoder layer's ``input_layernorm`` and SwiGLU ``mlp``
  modules of a transformers ``LlamaForCausalLM`` at the shared shape, patched by plait
  (``PatchConfig(policy="always")``) against the same transformers module unpatched, same weights.
* ``tiny-llama forward``: a whole ``LlamaForCausalLM`` at the shared benchmark shape (vocab 4096,
  hidden 256, 8 layers, 4 heads of 64, SwiGLU 688), patched against an unpatched copy with the
  same weights, for a prefill and for one decode step with a KV cache, patched with
  ``PatchConfig(policy="always")``: on CPU the default ``policy="auto"`` keeps HF's own code (so the
  default patched model is the unpatched one), for the reason these rows show.
"""

from __future__ import annotations

import copy

import torch

from plait.kernels.bench import BenchRow, interleaved_timing, one_thread, timing_row
from plait.kernels.ops import apply_rotary, silu_and_mul
from plait.kernels.tolerances import tolerance

TINY_LLAMA = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=64, intermediate_size=688, max_position_embeddings=2048)


def _checked(name: str, ours, peer, peer_name: str, tol_key: str, *, steps: int) -> BenchRow:
    with torch.no_grad():
        got, expected = ours(), peer()
    tolerance(tol_key, torch.float32).assert_close(got, expected, what=name)
    with torch.no_grad():
        stats = interleaved_timing({"ours": ours, "peer": peer}, warmup=3, steps=steps)
    return timing_row(name, stats["ours"], peer_name, stats["peer"], target_ratio=1.0)


def silu_rows(quick: bool, *, steps: int) -> list[BenchRow]:
    """``silu_and_mul`` (reference path) against HF's ``act_fn(gate) * up``."""
    from transformers.activations import ACT2FN

    act = ACT2FN["silu"]
    rows = []
    for tokens in (64, 1024) if quick else (1, 64, 1024, 4096):
        x = torch.randn(tokens, 2 * TINY_LLAMA["intermediate_size"])

        def hf(x=x):
            gate, up = x.chunk(2, dim=-1)
            return act(gate) * up

        rows.append(_checked(f"silu_and_mul ref T={tokens} d=688 fp32", lambda x=x: silu_and_mul(x), hf,
                             "transformers ACT2FN[silu](gate)*up", "gated_activation_fwd", steps=steps))
    return rows


def rotary_rows(quick: bool, *, steps: int) -> list[BenchRow]:
    """In-place ``apply_rotary`` (reference path) against HF's ``apply_rotary_pos_emb``."""
    from transformers.models.llama import modeling_llama

    hf_fn = modeling_llama.apply_rotary_pos_emb
    rows = []
    q_heads, kv_heads, head = 4, 2, 64
    for seq in (128, 1024) if quick else (1, 128, 1024, 4096):
        q = torch.randn(1, seq, q_heads, head)
        k = torch.randn(1, seq, kv_heads, head)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head, 2).float() / head))
        freqs = torch.arange(seq).float()[:, None] * inv_freq
        tables = (freqs.cos(), freqs.sin())
        cos = torch.cat((tables[0], tables[0]), -1)[None]
        sin = torch.cat((tables[1], tables[1]), -1)[None]
        positions = torch.arange(seq)[None]
        name = f"rotary ref S={seq} Hq={q_heads} Hkv={kv_heads} D={head} fp32"
        with torch.no_grad():  # correctness on fresh copies first
            check_q, check_k = q.clone(), k.clone()
            apply_rotary(check_q, check_k, tables, positions, head_size=head, validate_positions=False)
            expected = hf_fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        tolerance("rotary_fwd", torch.float32).assert_close(check_q.transpose(1, 2), expected[0], what=name)
        tolerance("rotary_fwd", torch.float32).assert_close(check_k.transpose(1, 2), expected[1], what=name)
        # Timed in place on a working copy, as inside a model (a rotation keeps norms, so repeated
        # calls stay finite); HF allocates its outputs, which is part of its cost.
        work_q, work_k = q.clone(), k.clone()
        candidates = {
            "ours": lambda wq=work_q, wk=work_k, t=tables, p=positions: apply_rotary(
                wq, wk, t, p, head_size=head, validate_positions=False),
            "peer": lambda q=q, k=k, c=cos, s=sin: hf_fn(q.transpose(1, 2), k.transpose(1, 2), c, s),
        }
        with torch.no_grad():
            stats = interleaved_timing(candidates, warmup=3, steps=steps)
        rows.append(timing_row(name, stats["ours"], "transformers apply_rotary_pos_emb", stats["peer"],
                               target_ratio=1.0))
    return rows


def module_rows(quick: bool, *, steps: int) -> list[BenchRow]:
    """transformers' ``LlamaRMSNorm`` and SwiGLU ``LlamaMLP``, patched by plait against unpatched."""
    import transformers

    from plait.inference_kernels.patching import PatchConfig, apply

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1})
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plait_model = copy.deepcopy(hf_model)
    apply(plait_model, PatchConfig(policy="always"))
    hf_layer, plait_layer = hf_model.model.layers[0], plait_model.model.layers[0]
    rows = []
    for tokens in (64, 1024) if quick else (1, 64, 1024, 4096):
        x = torch.randn(1, tokens, TINY_LLAMA["hidden_size"])
        rows.append(_checked(f"LlamaRMSNorm T={tokens} H=256 fp32", lambda x=x: plait_layer.input_layernorm(x),
                             lambda x=x: hf_layer.input_layernorm(x), "transformers LlamaRMSNorm (unpatched)",
                             "hf_patched_logits", steps=steps))
        rows.append(_checked(f"LlamaMLP SwiGLU T={tokens} H=256 I=688 fp32", lambda x=x: plait_layer.mlp(x),
                             lambda x=x: hf_layer.mlp(x), "transformers LlamaMLP (unpatched)",
                             "hf_patched_logits", steps=steps))
    return rows


def model_rows(quick: bool, *, steps: int) -> list[BenchRow]:
    """A tiny-llama ``LlamaForCausalLM`` patched vs unpatched: prefill and one cached decode step."""
    import transformers

    from plait.inference_kernels.patching import PatchConfig, apply

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plait_model = copy.deepcopy(hf_model)
    # policy="always": the reference path itself is what these rows measure (the default "auto" keeps
    # HF's own code on CPU, because of what they show)
    apply(plait_model, PatchConfig(policy="always"))
    rows = []
    for seq in (128,) if quick else (32, 128, 512):
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (1, seq))

        def prefill(model, ids=ids):
            return model(ids).logits

        rows.append(_checked(f"tiny-llama prefill S={seq} fp32", lambda: prefill(plait_model),
                             lambda: prefill(hf_model), "transformers LlamaForCausalLM (unpatched)",
                             "hf_patched_logits", steps=steps))
        with torch.no_grad():
            caches = {name: m(ids, use_cache=True).past_key_values for name, m in
                      (("plait", plait_model), ("hf", hf_model))}
        step_ids = ids[:, -1:]

        def decode(model, name, step_ids=step_ids, caches=caches):
            cache = copy.deepcopy(caches[name])  # the step appends to the cache: start from the same one
            return model(step_ids, past_key_values=cache, use_cache=True).logits

        rows.append(_checked(f"tiny-llama decode step ctx={seq} fp32 (incl. cache copy)",
                             lambda: decode(plait_model, "plait"), lambda: decode(hf_model, "hf"),
                             "transformers LlamaForCausalLM (unpatched)", "hf_patched_logits", steps=steps))
    return rows


def run(quick: bool = False) -> list[BenchRow]:
    """All rows of this benchmark (CPU, fp32, one thread).

    Args:
        quick: fewer shapes and steps (keeps it well under a minute on 2 cores).

    Returns:
        The rows, each with ratio = ours / HF eager and target <= 1.0.
    """
    steps = 10 if quick else 20
    with one_thread():
        return (silu_rows(quick, steps=steps) + rotary_rows(quick, steps=steps) + module_rows(quick, steps=steps)
                + model_rows(quick, steps=steps))


if __name__ == "__main__":
    import sys

    from plait.kernels.bench import format_table

    print(format_table(run(quick="--quick" in sys.argv)))
