"""Every README results summary is rows of ``plait bench NAME [--quick] --table`` of a committed
results file, pasted verbatim: the table's header, a few of its rows (in the file's order), and its
date/machine/command line, nothing edited by hand. The full tables live on the results pages of the
documentation site, generated from the same files; a README keeps a short summary and links there.
Each README is also checked for the shape of a front door: title, install line, limits, then
the results summary last.

Reads files only (no suite runs, no other plait package imported), so it is fast and runs wherever
the source tree is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.kernels.bench import BenchRow, write_json
from plait.kernels.cli.bench import results_markdown
from plait.kernels.testing.readme_tables import assert_results_summary, assert_rows_of, table_above

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
    ("packages/onebit-optim/README.md", "packages/onebit-optim/benchmarks/results/onebit-optim-settings.json"),
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
    ("packages/zero-sharding/README.md", "packages/zero-sharding/benchmarks/results/deepspeed-shim.json"),
]


# (README, check-name prefix): each package README carries the rows of its own selftest checks,
# `plait selftest --table --only PREFIX` of the committed GPU run (docs/gpu.md).
SELFTEST = ROOT / "kernels/benchmarks/results/selftest.json"
SELFTEST_TABLES = [("packages/zero-sharding/README.md", "zero-sharding/"),
                   ("packages/offload-io/README.md", "offload-io/"),
                   ("packages/inference-kernels/README.md", "inference-kernels/")]


@pytest.mark.parametrize(("readme", "results"), TABLES, ids=[r for _, r in TABLES])
def test_readme_summary_rows_are_the_committed_results_rows(readme, results):
    readme_path, results_path = ROOT / readme, ROOT / results
    if not readme_path.is_file() or not results_path.is_file():
        pytest.skip(f"{readme} or {results} is not in this tree (an installed copy, not the checkout)")
    assert_results_summary(readme_path.read_text(), results_markdown(results_path), f"{readme} ({results})")


@pytest.mark.parametrize(("readme", "prefix"), SELFTEST_TABLES, ids=[p for _, p in SELFTEST_TABLES])
def test_package_readme_carries_its_selftest_rows(readme, prefix):
    readme_path = ROOT / readme
    if not readme_path.is_file() or not SELFTEST.is_file():
        pytest.skip(f"{readme} or {SELFTEST.name} is not in this tree (no GPU run committed yet, or an installed copy)")
    expected = results_markdown(SELFTEST, keep=lambda name: name.startswith(prefix))
    assert_results_summary(readme_path.read_text(), expected, f"{readme} (`plait selftest --table --only {prefix}`)")


@pytest.mark.parametrize("readme", sorted({r for r, _ in TABLES}))
def test_readme_links_to_its_results_page(readme):
    readme_path = ROOT / readme
    if not readme_path.is_file():
        pytest.skip(f"{readme} is not in this tree")
    package_dir = readme_path.parent.name
    page = "../docs/results/kernels.md" if package_dir == "kernels" else f"../../docs/results/{package_dir}.md"
    assert f"]({page})" in readme_path.read_text(), f"{readme} does not link to its results page {page}"


@pytest.mark.parametrize("readme", sorted({r for r, _ in TABLES}))
def test_readme_is_a_front_door(readme):
    """What it is and how to install it come first; its limits, then the results summary, last."""
    readme_path = ROOT / readme
    if not readme_path.is_file():
        pytest.skip(f"{readme} is not in this tree")
    text = readme_path.read_text()
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert text.startswith(f"# plait-{readme_path.parent.name}\n"), f"{readme}: the title is the distribution's name"
    limits = [i for i, line in enumerate(sections) if line.startswith("## Limits")]
    assert limits, f"{readme}: no '## Limits' section"
    assert sections[-1].startswith("## Results"), f"{readme}: the results summary is the last section"
    assert limits[0] < len(sections) - 1, f"{readme}: the limits come before the results"
    assert 0 <= text.find("pip install") < text.find("\n## Limits"), f"{readme}: say how to install before the limits"


def test_summary_rows_are_checked_against_the_committed_rows(tmp_path):
    rows = [BenchRow(benchmark=f"b{i}", figure="f", ours=float(i), target="<= 9", passed=True) for i in range(4)]
    expected = results_markdown(write_json(rows, tmp_path / "r.json", meta={"date": "d", "machine": "M",
                                                                             "command": "c"}))
    lines = expected.splitlines()
    summary = "\n".join(["# x", "", *lines[:2], lines[3], lines[5], "", lines[-1], ""])
    assert_results_summary(summary, expected, "ok")
    edited = summary.replace(lines[3], lines[3].replace("| 1 |", "| 1.5 |"))
    with pytest.raises(AssertionError, match="not a row of the committed results"):
        assert_results_summary(edited, expected, "edited")
    reordered = "\n".join(["# x", "", *lines[:2], lines[5], lines[3], "", lines[-1], ""])
    with pytest.raises(AssertionError, match="out of order"):
        assert_results_summary(reordered, expected, "reordered")
    with pytest.raises(AssertionError, match="no table with this generated line"):
        assert_results_summary("# nothing here\n", expected, "missing")
    with pytest.raises(AssertionError, match="1 to 1 rows, found 2"):
        assert_rows_of(table_above(summary, lines[-1]), lines[:-2], "long", max_rows=1)


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
