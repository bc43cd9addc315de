"""The plait command: report exits 0 here, bench lists and runs suites, unknown names are explained."""

import json

from plait.kernels.bench import BenchRow, TimingStats, format_table, interleaved_timing, timing_row, write_json
from plait.kernels.cli.main import main
from plait.kernels.cli.registry import import_name_of


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
    same = TimingStats.of([1.0, 1.1, 0.9, 1.0])
    row = timing_row("x", same, "peer", TimingStats.of([1.02, 1.1, 0.92, 1.0]), target_ratio=1.0)
    assert "within noise" in row.note
    rows = [row, BenchRow(benchmark="bytes", figure="bytes/rank", ours=10.0, peer="DDP", peer_value=20.0,
                          ratio=0.5, target="<= 1", passed=True)]
    table = format_table(rows)
    assert "PASS" in table and "benchmark" in table.splitlines()[0]
    path = write_json(rows, tmp_path / "r.json", meta={"suite": "t"})
    assert json.loads(path.read_text())["rows"][1]["ratio"] == 0.5
