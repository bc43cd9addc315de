"""``plait bench quantized-inference``: weight-only int8/int4/FP6 against unquantized HF and torchao.

One run, CPU, one torch thread:

* quality: an HF Llama of tiny-llama's shape (hidden 256, 8 layers, 4 heads of 64, SwiGLU 688)
  trained for 120 steps (batch 8 x 64 tokens) on the first 90% of the built-in corpus; perplexity on the last
  10% (held out) for fp32, int8, int4 group 64 and FP6, fp32 activations. tiny-llama's
  ``down_proj`` has in_features 688, which no int4 group size of 32/64/128 divides, so int4 keeps
  it in full precision (the note says so). Targets: int8 within 1%, int4 within 5% of fp32.
* greedy agreement: 64 greedy tokens of random (untrained) Llama and Qwen3-MoE models, int8 and
  int4 against fp32: the fraction of equal tokens (no target: random models' logits are nearly
  flat, so one flipped near-tie changes the rest of the sequence). Qwen3-MoE's fused experts are
  quantized too (``QuantizedExperts``); its routers stay fp32.
* speed: decode tokens/s of a random Llama of about 134M parameters (hidden 768, 12 layers,
  SwiGLU 2048, vocab 32000), batch 1 and 8, one step with a 64-token KV cache, and prefill of 128
  tokens; fp32 and bf16 HF against int8 and int4 (every Linear and the head quantized, fp32
  activations, ``cpu_kernel="plait"``: plait's AVX2 kernels, a register-decoding GEMV for decode
  and fp32 GEMMs on weight blocks dequantized 128 rows at a time for prefill), and the same
  quantized models on torch's weight-packed kernels (``cpu_bf16_decode=True``: they are about 10x
  slower on fp32 inputs than on bf16 ones) as a peer. The extension's build (or cache load) time
  is a row of its own. Candidates alternate A B C D, D C B A, ... after warm-up;
  medians with p10/p90 in the note. Targets: int8 >= 1.5x fp32, int4 >= 2x fp32, prefill not
  more than 10% slower than fp32.
* memory: bytes of the quantized weights in the state dict against the formula (exact).

torchao rows (``Int8WeightOnlyConfig``, ``Int4WeightOnlyConfig(group_size=64)``, the same Linears
as plait's row) run when torchao is importable and its config runs on CPU; otherwise they say n/a
with the reason (torchao 0.18 has no CPU int4 weight-only format without its optional ``mslk``).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import time

import torch

from plait.inference_kernels.quantization.apply import QuantizeConfig, quantize
from plait.kernels.bench import BenchRow, TimingStats, one_thread
from plait.kernels.ops.quant_matmul import weight_nbytes
from plait.kernels.testing.data import corpus_tokens

TINY = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
            head_dim=64, intermediate_size=688, max_position_embeddings=1024)
BIG = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
           head_dim=64, intermediate_size=2048, max_position_embeddings=1024)
INT4 = QuantizeConfig(kind="int4", group_size=64, keep_original=False)
# Speed rows: fp32 model, head quantized too. plait's rows run its own AVX2 kernels (fp32
# activations); the "torch kernels" rows run torch's weight-packed ones on bf16-rounded decode inputs.
FAST = dict(head=True, keep_original=False)
TORCH_FAST = dict(FAST, cpu_bf16_decode=True)
INT8_TORCH = QuantizeConfig(kind="int8", **TORCH_FAST)
INT4_TORCH = QuantizeConfig(kind="int4", group_size=64, **TORCH_FAST)
# tiny-llama's down_proj (in_features 688) fits no int4 group size: kept in full precision there.
INT4_TINY = QuantizeConfig(kind="int4", group_size=64, keep_original=False, skip=("*.down_proj",))
INT8 = QuantizeConfig(kind="int8", keep_original=False)
FP6 = QuantizeConfig(kind="fp6", keep_original=False)


# "No worse than torchao at the same bits": both round to nearest per channel or group, so the two
# perplexities differ only where a code rounds the other way (6e-6 relative measured for int8);
# a 0.05% slack keeps that float noise from deciding the row, far below any real quality gap.
SAME_BITS_SLACK = 1.0005


def torchao_quantized(model: torch.nn.Module, label: str, *, head: bool) -> tuple[torch.nn.Module | None, str]:
    """A copy of ``model`` under torchao's weight-only config for ``label``, or None and why not.

    int8: ``Int8WeightOnlyConfig`` (per channel); int4: ``Int4WeightOnlyConfig(group_size=64)``.
    ``head`` says whether ``lm_head`` is quantized too (as in plait's row it is compared with). The
    copy runs one forward here, so a config torchao cannot run on CPU gives None with the reason.

    Returns:
        ``(model or None, note)``: the note names torchao's version, or why the row is n/a.
    """
    if importlib.util.find_spec("torchao") is None:
        return None, "torchao not installed (pip install torchao, matching the torch pin)"
    import torchao
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    out = copy.deepcopy(model)
    config = Int8WeightOnlyConfig() if label.startswith("int8") else Int4WeightOnlyConfig(group_size=64)
    try:
        quantize_(out, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and (head or fqn != "lm_head"))
        with torch.no_grad():
            out(input_ids=torch.zeros(1, 2, dtype=torch.long))
    except (ImportError, NotImplementedError, AssertionError, RuntimeError, ValueError) as exc:
        reason = str(exc).splitlines()[0][:120] if str(exc) else ""
        return None, f"torchao {torchao.__version__} {type(config).__name__} does not run on CPU: {reason}"
    return out, f"torchao {torchao.__version__} {type(config).__name__}"


def _llama(shape: dict, seed: int, dtype=torch.float32):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval().to(dtype)


def _split() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = corpus_tokens()
    cut = int(tokens.numel() * 0.9)
    return tokens[:cut], tokens[cut:]


def train_tiny(steps: int, *, batch: int = 8, seq: int = 64) -> torch.nn.Module:
    """tiny-llama's shape as an HF Llama, trained on the corpus's first 90% (AdamW, lr 2e-3).

    Not timed: :func:`run` calls it before it switches to one thread.
    """
    model = _llama(TINY, seed=0).train()
    train, _ = _split()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        if step % 20 == 0:
            print(f"quantized-inference: training step {step}/{steps}", flush=True)
        starts = torch.randint(0, train.numel() - seq - 1, (batch,), generator=gen)
        windows = torch.stack([train[s: s + seq + 1] for s in starts.tolist()])
        loss = model(input_ids=windows[:, :-1], labels=windows[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def perplexity(model: torch.nn.Module, *, seq: int = 256) -> float:
    """exp(mean next-token loss) over the held-out 10% in non-overlapping windows."""
    _, held = _split()
    windows = held[: (held.numel() // seq) * seq].view(-1, seq)
    total, count = 0.0, 0
    for chunk in windows.split(8):
        logits = model(input_ids=chunk).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 chunk[:, 1:].reshape(-1), reduction="sum")
        total, count = total + loss.item(), count + chunk[:, 1:].numel()
    return math.exp(total / count)


def quality_rows(base: torch.nn.Module, steps: int) -> list[BenchRow]:
    """Perplexity of the trained tiny model (``steps`` of training): fp32 against int8, int4 g64 and FP6."""
    ref = perplexity(base)
    rows = [BenchRow(benchmark=f"tiny-llama HF trained {steps} steps, held-out text", figure="perplexity",
                     ours=ref, note="fp32, unquantized")]
    for label, config, target in (("int8", INT8, 1.01), ("int4 g64", INT4_TINY, 1.05), ("fp6 e3m2", FP6, None)):
        model = copy.deepcopy(base)
        report = quantize(model, config)
        ppl = perplexity(model)
        kept = sorted({n.rsplit(".", 1)[-1] for n, why in report.kept if "skipped by pattern" in why})
        note = "fp32 activations" + (f"; {', '.join(kept)} (in_features 688) kept in full precision" if kept else "")
        rows.append(BenchRow(benchmark=f"tiny-llama {label}, held-out text", figure="perplexity", ours=ppl,
                             peer="fp32 HF", peer_value=ref, ratio=ppl / ref,
                             target="" if target is None else f"<= {target:g}",
                             passed=None if target is None else ppl / ref <= target, note=note))
        if label != "fp6 e3m2":
            theirs, why = torchao_quantized(base, label, head=False)
            peer_ppl = None if theirs is None else perplexity(theirs)
            rows.append(BenchRow(benchmark=f"tiny-llama {label}, held-out text", figure="perplexity", ours=ppl,
                                 peer=f"torchao {label.split()[0]} weight-only", peer_value=peer_ppl,
                                 ratio=None if peer_ppl is None else ppl / peer_ppl,
                                 target="" if peer_ppl is None else f"<= {SAME_BITS_SLACK:g}",
                                 passed=None if peer_ppl is None else ppl / peer_ppl <= SAME_BITS_SLACK,
                                 note=why + ("" if label == "int8" or peer_ppl is None else "; torchao quantizes "
                                             "down_proj too")))
    return rows


def agreement_rows(tokens: int) -> list[BenchRow]:
    """Greedy-token agreement of int8/int4 with fp32 on random Llama and Qwen3-MoE models."""
    import transformers

    small = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=512)
    rows = []
    for family in ("llama", "qwen3_moe"):
        torch.manual_seed(0)
        config = (transformers.LlamaConfig(**small) if family == "llama" else
                  transformers.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256))
        base = transformers.AutoModelForCausalLM.from_config(config).eval()
        prompt = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = base.generate(prompt, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)[0, 16:]
        for label, qconfig in (("int8", INT8), ("int4 g64", INT4)):
            model = copy.deepcopy(base)
            report = quantize(model, qconfig)
            experts = sum(".experts" in name for name in report.quantized)
            with torch.no_grad():
                got = model.generate(prompt, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)[0, 16:]
            same = (got == want).float().mean().item()
            first = int((got != want).nonzero()[0, 0]) if same < 1 else tokens
            rows.append(BenchRow(benchmark=f"random {family} {label}, {tokens} greedy tokens",
                                 figure="tokens equal to fp32 (fraction)", ours=same,
                                 note=f"first difference at token {first}; fp32 activations"
                                 + (f"; {experts} fused experts modules quantized" if experts else "")))
    return rows


def _alternating(candidates: dict, *, warmup: int, rounds: int) -> dict[str, TimingStats]:
    """A B C D, D C B A, ...: each candidate sees every position equally often (load drifts cancel)."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - start)
    return {name: TimingStats.of(t) for name, t in times.items()}


def _decode_step(model, batch: int, context: int):
    from transformers import DynamicCache

    ids = torch.randint(0, 32000, (batch, context), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    step = torch.randint(0, 32000, (batch, 1), generator=torch.Generator().manual_seed(3))

    def run():
        with torch.no_grad():
            model(input_ids=step, past_key_values=cache, use_cache=True)
        cache.crop(-1)

    return run


def _prefill(model, tokens: int):
    ids = torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(4))

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    return run


def own_kernel_configs() -> tuple[QuantizeConfig, QuantizeConfig, BenchRow]:
    """The int8/int4 configs of plait's speed rows and a row with the extension's build/load time.

    ``cpu_kernel="plait"`` where plait's CPU extension can be had (built here on first use, then
    cached); otherwise torch's kernels, and the row says why.
    """
    from plait.kernels.ops import quant_matmul_cpu

    start = time.perf_counter()
    ok = quant_matmul_cpu.available()
    seconds = quant_matmul_cpu.build_seconds if ok else time.perf_counter() - start
    how = "compiled here" if quant_matmul_cpu.compiled else "loaded the library an earlier process compiled"
    note = (f"first use in this process: {how}" if ok else f"not available ({quant_matmul_cpu.build_error}): the "
            "int8/int4 rows below run torch's kernels")
    row = BenchRow(benchmark="plait CPU extension (quant_matmul_cpu)", figure="build or load (s)", ours=seconds,
                   note=note)
    if not ok:
        return INT8_TORCH, INT4_TORCH, row
    return (QuantizeConfig(kind="int8", cpu_kernel="plait", **FAST),
            QuantizeConfig(kind="int4", group_size=64, cpu_kernel="plait", **FAST), row)


def speed_rows(rounds: int) -> list[BenchRow]:
    """Decode tokens/s (batch 1, 8) and prefill time of the ~134M Llama: fp32/bf16 vs int8/int4.

    plait's int8/int4 rows run its own CPU kernels; torch's weight-packed kernels (bf16 decode)
    are timed in the same rounds as a peer.
    """
    int8_fast, int4_fast, build_row = own_kernel_configs()
    fp32 = _llama(BIG, seed=0)
    params = sum(p.numel() for p in fp32.parameters())
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    models = {"fp32 HF": fp32, "bf16 HF": bf16}
    for label, config in (("int8", int8_fast), ("int4 g64", int4_fast), ("int8 torch kernels", INT8_TORCH),
                          ("int4 g64 torch kernels", INT4_TORCH)):
        models[label] = copy.deepcopy(fp32)
        quantize(models[label], config)
    torchao = {label: torchao_quantized(fp32, label, head=True) for label in ("int8", "int4 g64")}
    for label, (model, _) in torchao.items():
        if model is not None:
            models[f"torchao {label}"] = model
    rows = []
    for batch in (1, 8):
        stats = _alternating({k: _decode_step(m, batch, 64) for k, m in models.items()}, warmup=2, rounds=rounds)
        for label, target in (("int8", 1.5), ("int4 g64", 2.0)):
            for peer in ("fp32 HF", "bf16 HF", f"{label} torch kernels"):
                ours, theirs = batch / stats[label].median, batch / stats[peer].median
                goal = target if peer == "fp32 HF" else None
                rows.append(BenchRow(
                    benchmark=f"Llama {params / 1e6:.0f}M decode batch {batch}, {label}",
                    figure="tokens/s", ours=ours, peer=peer, peer_value=theirs, ratio=ours / theirs,
                    target="" if goal is None else f">= {goal:g}",
                    passed=None if goal is None else ours / theirs >= goal,
                    note=f"step p10/median/p90 ms ours {_ms(stats[label])}, peer {_ms(stats[peer])}"))
            peer = stats.get(f"torchao {label}")
            ours = batch / stats[label].median
            rows.append(BenchRow(benchmark=f"Llama {params / 1e6:.0f}M decode batch {batch}, {label}",
                                 figure="tokens/s", ours=ours, peer=f"torchao {label.split()[0]} weight-only",
                                 peer_value=None if peer is None else batch / peer.median,
                                 ratio=None if peer is None else ours * peer.median / batch,
                                 target="" if peer is None else ">= 1",
                                 passed=None if peer is None else ours * peer.median / batch >= 1,
                                 note=torchao[label][1] + ("" if peer is None else
                                                           f"; step p10/median/p90 ms peer {_ms(peer)}")))
    stats = _alternating({k: _prefill(m, 128) for k, m in models.items() if not k.startswith("torchao")}, warmup=1,
                         rounds=max(4, rounds // 2))
    for label in ("bf16 HF", "int8", "int4 g64", "int8 torch kernels", "int4 g64 torch kernels"):
        ratio = stats[label].median / stats["fp32 HF"].median
        goal = label in ("int8", "int4 g64")
        rows.append(BenchRow(benchmark=f"Llama {params / 1e6:.0f}M prefill 128 tokens, {label}", figure="time (ms)",
                             ours=stats[label].median * 1e3, peer="fp32 HF", peer_value=stats["fp32 HF"].median * 1e3,
                             ratio=ratio, target="<= 1.1" if goal else "", passed=ratio <= 1.1 if goal else None,
                             note=f"p10/median/p90 ms ours {_ms(stats[label])}, peer {_ms(stats['fp32 HF'])}"))
    rows += bytes_rows(models, {"int8": int8_fast, "int4 g64": int4_fast})
    return [build_row] + rows


def _ms(s: TimingStats) -> str:
    return f"{s.p10 * 1e3:.1f}/{s.median * 1e3:.1f}/{s.p90 * 1e3:.1f}"


def bytes_rows(models: dict, configs: dict[str, QuantizeConfig]) -> list[BenchRow]:
    """Quantized weights' bytes in the state dict against :func:`weight_nbytes` (must be equal)."""
    rows = []
    dense = {n: tuple(m.weight.shape) for n, m in models["fp32 HF"].named_modules()
             if isinstance(m, torch.nn.Linear)}
    for label, config in configs.items():
        sd = models[label].state_dict()
        stored = sum(t.numel() * t.element_size() for k, t in sd.items()
                     if k.rsplit(".", 1)[-1] in ("weight_codes", "weight_scales", "weight_zeros"))
        formula = sum(weight_nbytes(s, config.scheme) for s in dense.values())
        bf16_bytes = sum(2 * a * b for a, b in dense.values())
        rows.append(BenchRow(benchmark=f"Llama Linears incl. head, {label}", figure="weight bytes", ours=stored,
                             peer="formula", peer_value=formula, ratio=stored / formula, target="== 1",
                             passed=stored == formula, note=f"{stored / bf16_bytes:.3f}x the bf16 bytes"))
    return rows


def run(quick: bool = False) -> list[BenchRow]:
    """Run the suite (quality, agreement, speed, bytes) on CPU, one torch thread.

    Args:
        quick: 40 training steps instead of 120 and 8 timing rounds instead of 20.

    Returns:
        The table's rows.
    """
    if importlib.util.find_spec("transformers") is None:
        return [BenchRow(benchmark="quantized-inference", figure="-", ours=float("nan"),
                         note="transformers not installed: pip install 'plait-inference-kernels[hf]'")]
    steps = 40 if quick else 120
    base = train_tiny(steps)
    with one_thread():
        return (quality_rows(base, steps) + agreement_rows(64)
                + speed_rows(8 if quick else 20))


def main() -> None:
    """``python -m plait.inference_kernels.quantization.benchmark [--quick] [--out PATH]``."""
    import argparse
    from pathlib import Path

    from plait.kernels.bench import format_table, load_average, run_meta, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    load = load_average()
    rows = run(args.quick)
    print(format_table(rows))
    write_json(rows, args.out, meta=run_meta("plait bench quantized-inference" + (" --quick" if args.quick else ""),
                                             load, suite="quantized-inference", quick=args.quick))


if __name__ == "__main__":
    main()
