"""Every README benchmark table is ``plait bench NAME [--quick] --table`` of a committed results file,
pasted verbatim (issue 18): the table, its date/machine/command line, nothing edited by hand.

Reads files only (no suite runs, no other plait package imported), so it is fast and runs wherever
the source tree is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.kernels.bench import BenchRow, write_json
from plait.kernels.cli.bench import results_markdown

ROOT = Path(__file__).resolve().parents[2]

# (README, committed results file): each README carries that file's --table output verbatim.
TABLES = [
    ("kernels/README.md", "kernels/benchmarks/results/kernels-quick.json"),
    ("kernels/README.md", "kernels/benchmarks/results/kernels.json"),
    # the GPU selftest's table (docs/gpu.md): checked once a GPU run's file is committed
    ("kernels/README.md", "kernels/benchmarks/results/selftest.json"),
    ("packages/inference-kernels/README.md", "packages/inference-kernels/benchmarks/results/inference-kernels.json"),
    ("packages/inference-kernels/README.md",
     "packages/inference-kernels/benchmarks/results/quantized-inference-quick.json"),
    ("packages/moe-layers/README.md", "packages/moe-layers/benchmarks/results/moe-layers.json"),
    ("packages/moe-layers/README.md", "packages/moe-layers/benchmarks/results/moe-layers-quality.json"),
    ("packages/ulysses-sp/README.md", "packages/ulysses-sp/benchmarks/results/ulysses-sp.json"),
    ("packages/onebit-optim/README.md", "packages/onebit-optim/benchmarks/results/onebit-optim.json"),
    ("packages/onebit-optim/README.md", "packages/onebit-optim/benchmarks/results/onebit-optim-quality.json"),
    ("packages/offload-io/README.md", "packages/offload-io/benchmarks/results/offload-io.json"),
    ("packages/offload-io/README.md", "packages/offload-io/benchmarks/results/offload-io-capacity.json"),
    ("integrations/lightning/README.md", "integrations/lightning/benchmarks/results/lightning.json"),
    ("integrations/lightning/README.md", "integrations/lightning/benchmarks/results/main-job.json"),
    ("integrations/transformers/README.md", "integrations/transformers/benchmarks/results/transformers.json"),
    ("integrations/transformers/README.md",
     "integrations/transformers/benchmarks/results/transformers-quick.json"),
    ("packages/universal-ckpt/README.md", "packages/universal-ckpt/benchmarks/results/universal-ckpt.json"),
    ("packages/universal-ckpt/README.md", "packages/universal-ckpt/benchmarks/results/universal-ckpt-quick.json"),
    ("integrations/vllm/README.md", "integrations/vllm/benchmarks/results/vllm.json"),
    ("integrations/vllm/README.md", "integrations/vllm/benchmarks/results/vllm_load_rows.json"),
    ("packages/zero-sharding/README.md", "packages/zero-sharding/benchmarks/results/zero-sharding.json"),
    ("packages/zero-sharding/README.md", "packages/zero-sharding/benchmarks/results/zero-sharding-nodes.json"),
    ("packages/zero-sharding/README.md", "packages/zero-sharding/benchmarks/results/zero-sharding-quick.json"),
    ("packages/zero-sharding/README.md", "packages/zero-sharding/benchmarks/results/compile.json"),
    ("packages/zero-sharding/README.md", "packages/zero-sharding/benchmarks/results/compile-quick.json"),
]


# (README, check-name prefix): each package README carries the rows of its own selftest checks,
# `plait selftest --table --only PREFIX` of the committed GPU run (docs/gpu.md).
SELFTEST = ROOT / "kernels/benchmarks/results/selftest.json"
SELFTEST_TABLES = [("packages/zero-sharding/README.md", "zero-sharding/"),
                   ("packages/offload-io/README.md", "offload-io/"),
                   ("packages/inference-kernels/README.md", "inference-kernels/")]


@pytest.mark.parametrize(("readme", "results"), TABLES, ids=[r for _, r in TABLES])
def test_readme_table_is_the_committed_results_table(readme, results):
    readme_path, results_path = ROOT / readme, ROOT / results
    if not readme_path.is_file() or not results_path.is_file():
        pytest.skip(f"{readme} or {results} is not in this tree (an installed copy, not the checkout)")
    expected = results_markdown(results_path)
    assert expected in readme_path.read_text(), (
        f"{readme} does not carry `plait bench ... --table` of {results} verbatim; regenerate its table "
        f"from that command's output (or update the results with --update-results first)")


@pytest.mark.parametrize(("readme", "prefix"), SELFTEST_TABLES, ids=[p for _, p in SELFTEST_TABLES])
def test_package_readme_carries_its_selftest_rows(readme, prefix):
    readme_path = ROOT / readme
    if not readme_path.is_file() or not SELFTEST.is_file():
        pytest.skip(f"{readme} or {SELFTEST.name} is not in this tree (no GPU run committed yet, or an installed copy)")
    expected = results_markdown(SELFTEST, keep=lambda name: name.startswith(prefix))
    assert expected in readme_path.read_text(), (
        f"{readme} does not carry `plait selftest --table --only {prefix}` verbatim; paste that command's output")


def test_results_markdown_keeps_only_the_rows_asked_for(tmp_path):
    rows = [BenchRow(benchmark="zero-sharding/zero3", figure="f", ours=1.0),
            BenchRow(benchmark="offload-io/pinned", figure="f", ours=2.0)]
    path = write_json(rows, tmp_path / "s.json", meta={"date": "d", "machine": "M", "command": "c"})
    table = results_markdown(path, keep=lambda name: name.startswith("zero-sharding/"))
    assert "zero-sharding/zero3" in table and "offload-io/pinned" not in table
    assert "offload-io/pinned" in results_markdown(path)


def test_results_markdown_prints_date_machine_load_and_command(tmp_path):
    rows = [BenchRow(benchmark="b", figure="time (ms)", ours=1.0, peer="p", peer_value=2.0, ratio=0.5),
            BenchRow(benchmark="b", figure="time (ms)", ours=1.0, peer="gone", note="not installed")]
    path = write_json(rows, tmp_path / "x.json", meta={"date": "2026-11-25T14:00:00+00:00", "machine": "M",
                                                        "command": "plait bench x", "cpus": 2,
                                                        "load_average": [3.21, 4.5]})
    text = results_markdown(path).splitlines()
    assert text[0].startswith("| benchmark |") and text[3].split(" | ")[4] == "n/a"
    assert text[-1] == ("2026-11-25T14:00:00+00:00, M, 2 CPUs, 1-min load average 3.2 before / 4.5 after "
                        "(other jobs' CPU use; the timings are as noisy as that), `plait bench x` (x.json)")
    # an older file without CPUs or load prints as before
    path = write_json(rows, tmp_path / "y.json", meta={"date": "d", "machine": "M", "command": "c"})
    assert results_markdown(path).splitlines()[-1] == "d, M, `c` (y.json)"
