"""Process CPU time per decode token of vLLM's compiled engine on a random Mixtral: plugin off,
plugin on with its default per-op CPU choice, and plugin on with ``PLAIT_VLLM_CPU_PATH=plait``
(plait's torch-reference MoE inside the compiled model).

CPU time rather than wall time, so that other jobs on a shared machine disturb the comparison
less; one OpenMP thread (bound to core 0), so that no thread spins while it waits. Each side runs
in its own engine process (``plait.vllm.benchmarks.engine_worker --compiled``), in the order given.

    .venv-vllm/bin/python integrations/vllm/benchmarks/compiled_moe_cpu.py [--order off,plait,auto,auto,plait,off]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plait.vllm.benchmarks.suite import FULL, _build_model

SIDES = {"off": {"PLAIT_VLLM": "0"}, "auto": {"PLAIT_VLLM": "1"},
         "plait": {"PLAIT_VLLM": "1", "PLAIT_VLLM_CPU_PATH": "plait"}}
BATCH, PROMPT, NEW, ROUNDS = 8, 32, 32, 4


def _run(tmp: Path, model: Path, side: str, index: int) -> list[float]:
    """One engine process; its rounds' decode CPU seconds per token."""
    out = tmp / f"{side}{index}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1", **SIDES[side]}
    cmd = [sys.executable, "-m", "plait.vllm.benchmarks.engine_worker", "--model", str(model), "--compiled",
           "--batch", str(BATCH), "--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--rounds", str(ROUNDS),
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500, cwd=tmp)
    if result.returncode:
        raise RuntimeError(f"{side}: {(result.stdout + result.stderr)[-2000:]}")
    run = json.loads(out.read_text())
    return [(full - one) / (NEW - 1) for full, one in zip(run["cpu_seconds"], run["prefill_cpu_seconds"])]


def main() -> None:
    """Print each side's median decode CPU ms per token and its ratio to the plugin off."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", default="off,plait,auto,auto,plait,off")
    args = parser.parse_args()
    per_token: dict[str, list[float]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model, _ = _build_model(tmp, FULL[0], "mixtral")
        for index, side in enumerate(args.order.split(",")):
            per_token[side] += _run(tmp, model, side, index)
    off = statistics.median(per_token["off"])
    for side, values in per_token.items():
        if values:
            median = statistics.median(values)
            print(f"{side:6} decode CPU ms/token {median * 1e3:.2f} (min {min(values) * 1e3:.2f}, "
                  f"max {max(values) * 1e3:.2f}, {len(values)} rounds)  / off {median / off:.2f}")


if __name__ == "__main__":
    main()
