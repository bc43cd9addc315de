"""The optimizers benchmark's rows (plait.zero_sharding.benchmarks.optimizers): targets judged as the
module says, and the README's summary rows are the committed quick results file's rows, verbatim. The
suite itself runs for a minute or more, so CI checks its pieces; the memory rows' measurement is the
exact-ledger test of tests/test_zero_sharding_low_precision.py."""

from __future__ import annotations

import pathlib

import pytest

from plait.kernels.cli.bench import results_markdown
from plait.kernels.testing.readme_tables import assert_results_summary
from plait.zero_sharding.benchmarks import optimizers


def _curve(final: float) -> list[float]:
    return [5.0] * 10 + [final] * optimizers.TAIL


def test_quality_rows_hold_muon_and_low_precision_to_their_targets() -> None:
    losses = {"AdamW fp32": _curve(2.0), "Muon + AdamW": _curve(1.9), "AdamW bf16 masters + states": _curve(2.015),
              "AdamW int8 states": _curve(2.05)}
    rows = {row.benchmark.split(": ")[-1]: row for row in optimizers.quality_rows(losses, "t", None)}
    assert set(rows) == {"Muon + AdamW", "AdamW bf16 masters + states", "AdamW int8 states"}
    assert rows["Muon + AdamW"].passed is True and rows["Muon + AdamW"].ratio == pytest.approx(0.95)
    assert rows["AdamW bf16 masters + states"].passed is True  # 0.75% above
    assert rows["AdamW int8 states"].passed is False  # 2.5% above
    worse = optimizers.quality_rows({**losses, "Muon + AdamW": _curve(2.1)}, "t", None)
    assert worse[0].passed is False


def test_memory_rows_are_exact_or_fail() -> None:
    psi = 1024
    found = {"fp32 AdamW": {"bytes": 16 * psi // 2 + 4 * 3, "psi": psi, "tensors": 3},
             "bf16 masters (stochastic) + bf16 states": {"bytes": 8 * psi // 2 + 4 * 3 + 2, "psi": psi,
                                                         "tensors": 3}}
    rows = optimizers.memory_rows(found)
    assert rows[0].passed is True and rows[0].peer_value == pytest.approx((8 * psi + 12) / psi)
    assert rows[1].passed is False  # two bytes off


def test_memory_model_divides_into_whole_blocks_per_rank() -> None:
    for p in optimizers.memory_model().parameters():
        assert p.numel() % (optimizers.WORLD * 256) == 0


def test_readme_table_is_the_committed_quick_results() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    readme, results = root / "README.md", root / "benchmarks" / "results" / "optimizers-quick.json"
    if not readme.is_file() or not results.is_file():
        pytest.skip("not a source checkout")
    # the README's summary rows are rows of `plait bench optimizers --quick --table`, verbatim
    assert_results_summary(readme.read_text(), results_markdown(results), "README optimizers summary")
