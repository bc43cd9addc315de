"""The benchmark's PNG goes where the run's JSON goes: never into the current directory or the
checkout unless ``--update-results`` asks for the committed results."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.kernels.cli.bench import plot_path


def test_default_is_the_bench_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_BENCH_DIR", str(tmp_path / "bench"))
    path = plot_path("ulysses-sp", "ulysses-sp-memory", quick=False, argv=["plait", "bench", "ulysses-sp"])
    assert path.parent == tmp_path / "bench" and path.name.startswith("ulysses-sp-memory-")
    out = plot_path("ulysses-sp", "ulysses-sp-memory", quick=True,
                    argv=["plait", "bench", "ulysses-sp", "--quick", "--out", str(tmp_path / "r.json")])
    assert out == tmp_path / "r-ulysses-sp-memory.png"


def test_update_results_writes_the_committed_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.kernels.cli.bench import committed_results

    monkeypatch.setenv("PLAIT_BENCH_DIR", str(tmp_path / "bench"))
    committed = committed_results("ulysses-sp", "ulysses-sp-quick")
    path = plot_path("ulysses-sp", "ulysses-sp-memory", quick=True, argv=["plait", "bench", "ulysses-sp", "--quick",
                                                            "--update-results"])
    expected = tmp_path / "bench" if committed is None else committed.parent
    assert path.parent == expected and path.name.startswith("ulysses-sp-memory-quick")


def test_the_plot_is_not_written_to_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from plait.ulysses_sp.benchmarks import suite

    monkeypatch.setenv("PLAIT_BENCH_DIR", str(tmp_path / "bench"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["plait", "bench", "ulysses-sp"])
    written = suite._plot({"baseline": {1024: 0.9, 2048: 1.3}}, quick=False)
    assert written is not None and Path(written).parent == tmp_path / "bench" and Path(written).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["bench"]
