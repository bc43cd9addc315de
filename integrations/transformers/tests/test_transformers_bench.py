"""The benchmark's wiring: registered under ``plait.benchmarks``, rows of a peer that cannot run
carry no value and the reason (the suite itself runs in ``plait bench transformers``)."""

from __future__ import annotations

from importlib.metadata import entry_points

from plait.transformers.benchmarks import suite


def test_registered_under_plait_benchmarks() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="plait.benchmarks")}
    assert found.get("transformers") == "plait.transformers.benchmarks.suite:run"


def test_memory_rows_compare_against_deepspeed_with_a_target() -> None:
    row = suite._memory_row("tiny", 100 << 20, 200 << 20, "deepspeed", "")
    assert (row.ours, row.peer_value, row.ratio, row.passed, row.target) == (100, 200, 0.5, True, "<= 1")
    beside = suite._memory_row("tiny", 100 << 20, 50 << 20, "ddp", "")
    assert beside.passed is None and beside.target == ""


def test_a_peer_that_cannot_run_has_no_value_and_says_why() -> None:
    row = suite._memory_row("tiny", 100 << 20, None, "deepspeed", "ImportError")
    assert row.peer_value is None and row.ratio is None and row.passed is None
    assert row.note == "ImportError"
