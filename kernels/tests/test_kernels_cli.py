"""The plait command: report exits 0 here, bench lists and runs suites, unknown names are explained."""

import io
import json
import subprocess
import sys

import pytest

from plait.kernels.bench import (
    BenchRow,
    TimingStats,
    format_table,
    interleaved_timing,
    ratio_stats,
    timing_row,
    write_json,
)
from plait.kernels.cli.main import main
from plait.kernels.cli.registry import import_name_of
from plait.kernels.progress import progress


def test_report_runs_and_exits_zero(capsys):
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    for section in ("== versions", "== devices", "== kernels", "== plait distributions", "torch "):
        assert section in out
    assert "rms_norm" in out


def test_bench_lists_and_refuses_unknown(capsys):
    assert main(["bench"]) == 0
    assert "kernels" in capsys.readouterr().out
    assert main(["bench", "no-such-suite"]) == 2
    assert "pip install plait-no-such-suite" in capsys.readouterr().out


def test_import_names_follow_design_rule():
    assert import_name_of("plait-zero-sharding") == "plait.zero_sharding"
    assert import_name_of("plait-kernels") == "plait.kernels"
    assert import_name_of("plait") == "plait"


def test_table_json_and_noise_calls(tmp_path):
    calls = {"a": 0, "b": 0}

    def bump(name):
        def step():
            calls[name] += 1
        return step

    stats = interleaved_timing({"a": bump("a"), "b": bump("b")}, warmup=2, steps=10)
    assert calls == {"a": 12, "b": 12} and len(stats["a"].samples) == 10
    ticks = iter(range(100))  # a clock that advances 1 s per read: every sample is exactly 1 s
    ticked = interleaved_timing({"a": bump("a")}, warmup=0, steps=3, clock=lambda: float(next(ticks)))
    assert ticked["a"].samples == (1.0, 1.0, 1.0)
    same = TimingStats.of([1.0, 1.1, 0.9, 1.0])
    row = timing_row("x", same, "peer", TimingStats.of([1.02, 1.1, 0.92, 1.0]), target_ratio=1.0)
    assert "within noise" in row.note
    rows = [row, BenchRow(benchmark="bytes", figure="bytes/rank", ours=10.0, peer="DDP", peer_value=20.0,
                          ratio=0.5, target="<= 1", passed=True)]
    table = format_table(rows)
    assert "PASS" in table and "benchmark" in table.splitlines()[0]
    path = write_json(rows, tmp_path / "r.json", meta={"suite": "t"})
    assert json.loads(path.read_text())["rows"][1]["ratio"] == 0.5


def _fake_suite(monkeypatch, tmp_path):
    """A suite named "fake" with one measured row and one peer that could not run."""
    (tmp_path / "fake_suite_mod.py").write_text(
        "from plait.kernels.bench import BenchRow\n"
        "def run(quick):\n"
        "    return [BenchRow(benchmark='b', figure='time (ms)', ours=1.5, peer='p', peer_value=3.0, ratio=0.5,\n"
        "                     target='<= 1', passed=True),\n"
        "            BenchRow(benchmark='b', figure='time (ms)', ours=1.5, peer='missing', note='not installed')]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from importlib import metadata

    from plait.kernels.cli import bench

    suites = {"fake": metadata.EntryPoint("fake", "fake_suite_mod:run", "plait.benchmarks")}
    monkeypatch.setattr(bench, "entry_points", lambda group: dict(suites))
    monkeypatch.setenv("PLAIT_BENCH_DIR", str(tmp_path / "runs"))
    return bench


def test_bench_writes_outside_the_source_tree_by_default(monkeypatch, tmp_path, capsys):
    _fake_suite(monkeypatch, tmp_path)
    assert main(["bench", "fake", "--quick"]) == 0
    out = capsys.readouterr().out
    written = list((tmp_path / "runs").glob("fake-quick-*.json"))
    assert len(written) == 1 and f"wrote {written[0]}" in out and "--update-results" in out
    assert main(["bench", "fake", "--quick"]) == 0  # a second run (same second) never overwrites the first
    assert len(list((tmp_path / "runs").glob("fake-quick-*.json"))) == 2


def test_bench_update_results_needs_a_source_checkout(monkeypatch, tmp_path, capsys):
    _fake_suite(monkeypatch, tmp_path)  # plait-fake is not installed, so there is no committed file
    assert main(["bench", "fake", "--update-results"]) == 2
    assert "editable" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_bench_table_from_results_and_missing_peer_is_na(monkeypatch, tmp_path, capsys):
    _fake_suite(monkeypatch, tmp_path)
    assert main(["bench", "fake", "--out", str(tmp_path / "r.json")]) == 0
    plain = capsys.readouterr().out
    assert plain.splitlines()[3].split()[5] == "n/a"  # the peer that could not run: no number
    assert main(["bench", "fake", "--table", "--out", str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| benchmark |") and table[1].startswith("|---")
    assert table[3].split(" | ")[4] == "n/a"
    assert "`plait bench fake`" in table[-1] and "+00:00" in table[-1]  # command and date printed
    assert main(["bench", "fake", "--table", "--out", str(tmp_path / "none.json")]) == 2


@pytest.mark.parametrize("argv", [["--help"], ["bench"], ["bench", "--help"], ["report", "--help"]])
def test_command_starts_without_importing_torch_or_plugins(argv):
    """Listing and help come from entry-point metadata: no plugin and no torch is imported."""
    probe = (f"import sys\nfrom plait.kernels.cli.main import main\ntry:\n    main({argv!r})\n"
             "except SystemExit:\n    pass\n"
             "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('plait.') and "
             "not m.startswith('plait.kernels'))\nprint('LOADED', loaded)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip().splitlines()[-1] == "LOADED []", result.stdout + result.stderr
    assert "usage: plait" in result.stdout or "benchmark suites:" in result.stdout


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_one_line_in_a_log():
    log = io.StringIO()
    with progress("converting", total=3 * 2**20, stream=log) as update:
        for _ in range(3):
            update(2**20)
    assert "\r" not in log.getvalue() and log.getvalue().startswith("converting: 3.0 MiB in ")
    assert log.getvalue().count("\n") == 1
    terminal = _Terminal()
    with progress("steps", total=4, unit="step", stream=terminal) as update:
        for _ in range(4):
            update(1)
    assert "\r" in terminal.getvalue() and "steps" in terminal.getvalue()


def test_alternation_is_abba_and_a_target_holds_by_the_ratio_p90():
    order = []
    interleaved_timing({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=0, steps=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # Medians 1.0 vs 1.0 (ratio 1.0 meets <= 1.05), but round by round ours is slower in 3 of 10.
    ours = TimingStats.of([1.0] * 7 + [1.3] * 3)
    peer = TimingStats.of([1.0] * 10)
    paired = ratio_stats(ours, peer)
    assert paired is not None and paired.median == 1.0 and paired.p90 == pytest.approx(1.3)
    row = timing_row("x", ours, "peer", peer, target_ratio=1.05)
    assert row.ratio == 1.0 and row.passed is False and "ratio p10/median/p90 1/1/1.3" in row.note
    assert timing_row("x", ours, "peer", peer, target_ratio=1.3).passed is True
    unpaired = TimingStats.of([1.0, 1.0])  # not from the same run: the medians decide
    assert ratio_stats(ours, unpaired) is None
    assert timing_row("x", ours, "peer", unpaired, target_ratio=1.05).passed is True
