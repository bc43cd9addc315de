"""Only the load rows of ``plait bench vllm`` (the FULL Llama, 76.3 MiB fp32), printed; no engine starts.

    .venv-vllm/bin/python integrations/vllm/benchmarks/load_rows.py [--repeats 20]

To measure an older reader the same way, put its sources first on ``PYTHONPATH`` (e.g. from
``git archive <commit> packages/universal-ckpt/src integrations/vllm/src``), keeping this script's
suite (``plait.vllm.benchmarks.suite``) in place for both.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    """Build the model once, stream it both ways, print one line per row."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from plait.vllm.benchmarks import suite

    with tempfile.TemporaryDirectory() as name:
        hf_dir, universal = suite._build_model(Path(name), suite.FULL[0], "llama")
        rows = suite._load_rows(hf_dir, universal, (*suite.FULL[:-1], args.repeats))
    for row in rows:
        print(f"{row.benchmark}: ours {row.ours:.2f} ms, {row.peer} {row.peer_value:.2f} ms, ratio {row.ratio:.2f}; "
              f"{row.note}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
