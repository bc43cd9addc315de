"""The optimizers benchmark's rows (plait.zero_sharding.benchmarks.optimizers and .optimizers_speed):
targets judged as the modules say, the speed rounds in ABBA order, and the README's summary rows are
the committed results file's rows, verbatim. The suite itself runs for many minutes, so CI checks its
pieces; the memory rows' measurement is the exact-ledger test of
tests/test_zero_sharding_low_precision.py."""

from __future__ import annotations

import pathlib

import pytest

from plait.kernels.cli.bench import results_markdown
from plait.kernels.testing.readme_tables import assert_results_summary
from plait.zero_sharding.benchmarks import optimizers, optimizers_speed


def _curve(final: float) -> list[float]:
    return [5.0] * 10 + [final] * optimizers.TAIL


def test_quality_rows_hold_muon_and_low_precision_to_their_targets() -> None:
    losses = {"AdamW fp32": _curve(2.0), "Muon + AdamW": _curve(1.9), "AdamW bf16 masters + states": _curve(2.015),
              "AdamW int8 states": _curve(2.05)}
    rows = {row.benchmark.split(": ")[-1]: row for row in optimizers.quality_rows({0: losses}, "t", None)}
    assert set(rows) == {"Muon + AdamW", "AdamW bf16 masters + states", "AdamW int8 states"}
    assert rows["Muon + AdamW"].passed is True and rows["Muon + AdamW"].ratio == pytest.approx(0.95)
    assert rows["AdamW bf16 masters + states"].passed is True  # 0.75% above
    assert rows["AdamW int8 states"].passed is False  # 2.5% above
    worse = optimizers.quality_rows({0: {**losses, "Muon + AdamW": _curve(2.1)}}, "t", None)
    assert worse[0].passed is False


def test_both_sided_rows_are_judged_on_the_mean_over_seeds() -> None:
    seed0 = {"AdamW fp32": _curve(2.0), "Muon + AdamW": _curve(1.9), "AdamW bf16 masters + states": _curve(1.97)}
    seed1 = {"AdamW fp32": _curve(2.0), "AdamW bf16 masters + states": _curve(2.01)}
    rows = {row.benchmark.split(": ")[-1]: row for row in optimizers.quality_rows({0: seed0, 1: seed1}, "t", None)}
    bf16 = rows["AdamW bf16 masters + states"]  # seed 0 alone: 1.5% below, outside the band; the mean: 1% below
    assert bf16.ours == pytest.approx(1.99) and bf16.peer_value == pytest.approx(2.0) and bf16.passed is True
    assert "mean over seeds 0, 1 (ratio per seed 0.9850, 1.0050)" in bf16.note
    assert rows["Muon + AdamW"].ratio == pytest.approx(0.95) and "seeds" not in rows["Muon + AdamW"].note


def test_memory_rows_are_exact_or_fail() -> None:
    psi = 1024
    found = {"fp32 AdamW": {"bytes": 16 * psi // 2 + 4 * 3, "psi": psi, "tensors": 3},
             "bf16 masters (stochastic) + bf16 states": {"bytes": 8 * psi // 2 + 4 * 3 + 2, "psi": psi,
                                                         "tensors": 3}}
    rows = optimizers.memory_rows(found)
    assert rows[0].passed is True and rows[0].peer_value == pytest.approx((8 * psi + 12) / psi)
    assert rows[1].passed is False  # two bytes off


def test_muon_memory_rows_have_no_step_counters_and_count_the_whole_tensors() -> None:
    psi, owned = 1024, 512
    found = {"Muon fp32": {"bytes": 12 * psi // 2 + 4 * owned, "psi": psi, "tensors": 0, "owned": owned}}
    (row,) = optimizers.memory_rows(found)
    assert row.passed is True and row.peer == "formula 12/W + 4 x owned" and row.ours == pytest.approx(8.0)
    assert "the owner's whole fp32 tensors: 512 elements (2048 bytes)" in row.note
    found["Muon fp32"]["bytes"] -= 4 * owned  # a ledger leaving them out fails
    assert not optimizers.memory_rows(found)[0].passed


def _stage(plait_step: float, alone: float, train: float, peer: float | None) -> dict[str, dict[str, list[float]]]:
    out = {"plait": {"step": [plait_step] * 10, "train": [train] * 10},
           optimizers_speed.ALONE: {"step": [alone] * 10, "train": []}}
    if peer is not None:
        out[optimizers_speed.DEEPSPEED] = {"step": [0.01] * 10, "train": [peer] * 10}
    return out


def test_speed_rows_pass_by_the_p90_and_report_deepspeed_missing() -> None:
    found = {"ZeRO-2": _stage(0.5, 1.0, 2.0, 1.5), "ZeRO-3": _stage(1.2, 1.0, 2.0, None),
             "deepspeed_error": {3: "ValueError: nope"}}
    rows = optimizers_speed.speed_rows(found, "m", 2)
    assert [(r.figure, r.passed) for r in rows] == [("optimizer step (ms)", True), ("fwd + bwd + step (ms)", False),
                                                    ("optimizer step (ms)", False), ("fwd + bwd + step (ms)", None)]
    assert rows[0].ratio == pytest.approx(0.5) and "ratio p10/median/p90 0.5/0.5/0.5" in rows[0].note
    assert rows[1].peer == "DeepSpeed 0.19.8 Muon ZeRO-2" and "backward" in rows[1].note
    assert rows[3].peer_value is None and rows[3].note == "DeepSpeed did not run on CPU: ValueError: nope"


def test_speed_rounds_alternate_and_skip_the_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimizers_speed.dist, "barrier", lambda: None)
    calls: list[str] = []
    contenders = {"a": (lambda r: calls.append(f"a-bwd{r}"), lambda: calls.append("a")),
                  "b": (None, lambda: calls.append("b"))}
    out = optimizers_speed._rounds(contenders, 3)
    expected = []
    for round_ in range(optimizers_speed.WARMUP + 3):
        pair = [[f"a-bwd{round_}", "a"], ["b"]]
        for item in pair if round_ % 2 == 0 else pair[::-1]:
            expected += item
    assert calls == expected  # A B, B A, ...: each backward right before its own step
    assert len(out["a"]["step"]) == len(out["a"]["train"]) == len(out["b"]["step"]) == 3 and out["b"]["train"] == []


def test_memory_model_divides_into_whole_blocks_per_rank() -> None:
    for p in optimizers.memory_model().parameters():
        assert p.numel() % (optimizers.WORLD * 256) == 0


def test_readme_table_is_the_committed_quick_results() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    readme, results = root / "README.md", root / "benchmarks" / "results" / "optimizers.json"
    if not readme.is_file() or not results.is_file():
        pytest.skip("not a source checkout")
    # the README's summary rows are rows of `plait bench optimizers --table`, verbatim
    assert_results_summary(readme.read_text(), results_markdown(results), "README optimizers summary")
