"""Only the load rows of ``plait bench vllm`` (the FULL Llama, 76.3 MiB fp32); no engine starts.

    .venv-vllm/bin/python integrations/vllm/benchmarks/load_rows.py [--repeats 20] [--out results.json]

Prints one line per row; ``--out`` also writes them as JSON with the date, the machine, the load
average before and after and the command. To measure an older reader the same way, put its
sources first on ``PYTHONPATH`` (e.g. from ``git archive <commit> packages/universal-ckpt/src
integrations/vllm/src``), keeping this script's suite (``plait.vllm.benchmarks.suite``) in place for both.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main() -> None:
    """Build the model once, stream it both ways, print one line per row (and write them with --out)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows here as JSON")
    args = parser.parse_args()
    from plait.kernels.bench import load_average, run_meta, write_json
    from plait.vllm.benchmarks import suite

    load_before = load_average()
    with tempfile.TemporaryDirectory() as name:
        hf_dir, universal = suite._build_model(Path(name), suite.FULL[0], "llama")
        rows = suite._load_rows(hf_dir, universal, (*suite.FULL[:-1], args.repeats))
    meta = run_meta(" ".join(["integrations/vllm/benchmarks/load_rows.py", *sys.argv[1:]]), load_before)
    before, after = meta["load_average"]
    for row in rows:
        print(f"{row.benchmark}: ours {row.ours:.2f} ms, {row.peer} {row.peer_value:.2f} ms, ratio {row.ratio:.2f}; "
              f"{row.note}; load average {before} -> {after}")
    if args.out is not None:  # the format plait bench writes: `plait bench vllm --table --out FILE` prints it
        write_json(rows, args.out, meta=meta)

if __name__ == "__main__":
    main()
