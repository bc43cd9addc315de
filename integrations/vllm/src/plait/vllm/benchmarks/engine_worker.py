"""One engine configuration of the vLLM benchmark, in its own process (``LLM()`` spawns; the plugin
is registered once per process, so "on" and "off" cannot share one).

    python -m plait.vllm.benchmarks.engine_worker --model DIR --out result.json [--load-format F] [--compiled]

Writes ``{"seconds": [...], "prefill_seconds": [...], "cpu_seconds": [...], "prefill_cpu_seconds": [...],
"tokens": N, "startup_seconds": s}``: the wall time of each timed ``generate`` round, of a one-token
round (prefill only) timed right after each, the process CPU time (all threads) of both, the tokens
each round generated and the engine's start-up time. CPU time is what a comparison on a loaded
machine can use (wall time counts the other jobs' turns), with one torch thread so that no OpenMP
thread spins while it waits. ``--compiled`` starts vLLM's
default compiled engine (no ``enforce_eager``); start-up then includes its compilation.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    """Start the engine, warm it up, time ``--rounds`` generate rounds, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="safetensors")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled engine (no enforce_eager)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, dtype="float32",
              enforce_eager=not args.compiled,
              skip_tokenizer_init=True, max_model_len=args.prompt_len + args.new_tokens + 8,
              max_num_seqs=args.batch, seed=0)
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 500 + 1 for j in range(args.prompt_len)])
               for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    prefill_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    seconds, prefill, cpu, prefill_cpu = [], [], [], []
    for _ in range(args.rounds):
        begin, begin_cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - begin)
        cpu.append(time.process_time() - begin_cpu)
        # The same prompts for one token: what the round spends outside decoding, so that
        # (round - prefill) / (new tokens - 1) is the decode time per token.
        begin, begin_cpu = time.perf_counter(), time.process_time()
        llm.generate(prompts, prefill_params, use_tqdm=False)
        prefill.append(time.perf_counter() - begin)
        prefill_cpu.append(time.process_time() - begin_cpu)
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    with open(args.out, "w") as file:
        json.dump({"seconds": seconds, "prefill_seconds": prefill, "cpu_seconds": cpu,
                   "prefill_cpu_seconds": prefill_cpu, "tokens": tokens, "startup_seconds": startup}, file)


if __name__ == "__main__":
    main()
