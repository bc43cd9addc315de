"""One vLLM engine run for the end-to-end tests (a script: ``LLM()`` starts processes, hence the guard).

Starts ``LLM(model, load_format)`` on the CPU platform, generates greedily from token-id prompts
(no tokenizer), and writes JSON: the generated token ids, the layer classes the engine built, and
the load time. With ``--corrupt DIR`` it then tries to start a second engine on the corrupted
checkpoint ``DIR`` and records the error it fails with.

    python vllm_engine_run.py --model DIR --load-format plait_universal --out result.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

PROMPTS = [[1, 17, 42, 99, 5], [7, 7, 300, 12], [250, 3]]
NEW_TOKENS = 12


def _engine_args(model: str, load_format: str) -> dict:
    return dict(model=model, load_format=load_format, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                max_model_len=128, max_num_seqs=4, seed=0)


def _layer_classes(model) -> list[str]:
    return sorted({type(module).__name__ for module in model.modules()})


def main() -> None:
    """Run the engine(s) and write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--corrupt", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict = {}
    start = time.perf_counter()
    llm = LLM(**_engine_args(args.model, args.load_format))
    result["startup_seconds"] = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    result["tokens"] = [list(out.outputs[0].token_ids) for out in outputs]
    result["layers"] = llm.apply_model(_layer_classes)[0]
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
