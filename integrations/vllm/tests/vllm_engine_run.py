"""One vLLM engine run for the end-to-end tests (a script: ``LLM()`` starts processes, hence the guard).

For each ``--job NAME=DIR@FORMAT`` in turn, starts ``LLM(DIR, load_format=FORMAT)`` on the CPU
platform (one engine at a time, in this process; ``--tp N``: with N tensor-parallel ranks),
generates greedily from token-id prompts (no tokenizer), and records the generated token ids, the
layer classes the engine built, the start-up time and each rank's ``plait_universal`` load report.
With ``--corrupt DIR`` it then tries to start an engine on the corrupted checkpoint ``DIR`` and
records the error it fails with. Writes everything as JSON to ``--out``.

    python vllm_engine_run.py --job llama=ckpt@plait_universal --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

from vllm_testing import NEW_TOKENS, PROMPTS  # beside this script, which runs with its folder on sys.path


def _engine_args(model: str, load_format: str, tp: int = 1, compile_backend: str | None = None) -> dict:
    args = dict(model=model, load_format=load_format, dtype="float32", enforce_eager=compile_backend is None,
                skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4, seed=0, tensor_parallel_size=tp)
    if compile_backend not in (None, "inductor"):  # "eager": dynamo traces and splits, no code generation
        args["compilation_config"] = {"backend": compile_backend}
    return args


def _layer_classes(model) -> list[str]:
    return sorted({type(module).__name__ for module in model.modules()})


def _quant_cpu_kernels(model) -> list[str]:
    """Whose CPU kernels the engine's QuantizedLinears run: ``plait`` only where plait's own kernels take them."""
    return sorted({("plait" if module._own else "torch") for module in model.modules()
                   if type(module).__name__ == "QuantizedLinear"})



def main() -> None:
    """Run the engine(s) and write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="append", required=True, help="NAME=MODEL_DIR@LOAD_FORMAT")
    parser.add_argument("--corrupt", default=None)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    parser.add_argument("--compile-backend", default=None,
                        help="leave vLLM's compilation on (its default: inductor) with this torch.compile backend "
                             "instead of enforce_eager=True")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict = {}
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    for job in args.job:
        name, _, rest = job.partition("=")
        model, _, load_format = rest.rpartition("@")
        start = time.perf_counter()
        llm = LLM(**_engine_args(model, load_format, args.tp, args.compile_backend))
        startup = time.perf_counter() - start
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        from plait.vllm.loader import load_report  # importable, so worker processes can unpickle it

        reports = [None if r is None else dataclasses.asdict(r) for r in llm.apply_model(load_report)]
        result[name] = {"tokens": [list(out.outputs[0].token_ids) for out in outputs], "startup_seconds": startup,
                        # a function of this script pickles only into this process (TP=1 runs here)
                        "layers": llm.apply_model(_layer_classes)[0] if args.tp == 1 else None,
                        "quant_cpu_kernels": llm.apply_model(_quant_cpu_kernels)[0] if args.tp == 1 else None,
                        "load_reports": reports}  # one per tensor-parallel rank
        del llm
    if args.corrupt:
        try:
            LLM(**_engine_args(args.corrupt, "plait_universal"))
            result["corrupt_error"] = None
        except Exception:  # noqa: BLE001 - the test inspects whatever vLLM raised
            result["corrupt_error"] = traceback.format_exc()
    with open(args.out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
