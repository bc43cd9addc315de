"""The benchmark's PNG goes where the run's JSON goes: never into the checkout or the current
directory unless ``--update-results`` asks for the committed results."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.kernels.cli.bench import plot_path


def test_default_is_the_bench_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_BENCH_DIR", str(tmp_path / "bench"))
    path = plot_path("onebit-optim", "onebit-optim-loss-vs-time", quick=True,
                     argv=["plait", "bench", "onebit-optim", "--quick"])
    assert path.parent == tmp_path / "bench" and path.name.startswith("onebit-optim-loss-vs-time-quick-")
    # not a bench command line
    assert plot_path("onebit-optim", "x", quick=False, argv=["pytest"]).parent == tmp_path / "bench"


def test_out_and_update_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_BENCH_DIR", str(tmp_path / "bench"))
    out = plot_path("onebit-optim", "onebit-optim-loss-vs-time", quick=False,
                    argv=["plait", "bench", "onebit-optim", "--out", str(tmp_path / "run.json")])
    assert out == tmp_path / "run-onebit-optim-loss-vs-time.png"
    from plait.kernels.cli.bench import committed_results

    committed = committed_results("onebit-optim", "onebit-optim")
    updated = plot_path("onebit-optim", "onebit-optim-loss-vs-time", quick=False,
                        argv=["plait", "bench", "onebit-optim", "--update-results"])
    if committed is None:  # not an editable install: no committed folder to update
        assert updated.parent == tmp_path / "bench"
    else:
        assert updated == committed.parent / "onebit-optim-loss-vs-time.png"


def test_the_plot_is_written_outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from plait.onebit_optim.benchmarks import suite

    monkeypatch.setenv("PLAIT_BENCH_DIR", str(tmp_path / "bench"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["plait", "bench", "onebit-optim", "--quick"])
    results = {"loopback": {"ddp_adamw": {"blocks": [{"seconds": 1.0, "losses": [3.0, 2.5]}]}}}
    path = suite._plot(results, quick=True)
    assert path is not None and path.parent == tmp_path / "bench" and path.stat().st_size > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["bench"]  # nothing in the current directory


def test_zero_rows_are_against_zero_adamw_of_their_stage() -> None:
    from plait.onebit_optim.benchmarks import suite

    def result(seconds: float, nbytes: int) -> dict:
        return {"blocks": [{"seconds": seconds, "losses": [1.0] * 4, "bytes": nbytes, "timed": True}], "numel": 10}

    results = {"1gbit": {"ddp_adamw": result(4.0, 400), "zero2_adamw": result(4.4, 440),
                         "zero2_onebit_adam": result(2.2, 44)}}
    rows = {row.benchmark.split(",")[0]: row for row in suite._rows(results, None)}
    onebit, zero = rows["zero2_onebit_adam step"], rows["zero2_adamw step"]
    assert onebit.peer == "ZeRO-2 + AdamW" and onebit.ratio == 0.5 and onebit.target == ""
    assert rows["zero2_onebit_adam bytes"].ratio == 0.1 and rows["zero2_onebit_adam bytes"].target == ""
    assert zero.peer == "DDP + AdamW" and abs(zero.ratio - 1.1) < 1e-12
