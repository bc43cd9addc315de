"""``plait io bench`` and the entry points the ``plait`` command discovers."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from plait.offload_io import cli, io_bench

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plait")
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_entry_points_resolve():
    entry_points = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    targets = [entry_points["plait.commands"]["io"], entry_points["plait.benchmarks"]["offload-io"]]
    for target in targets:
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_io_bench_sweeps_and_prints_the_best_setting(tmp_path, monkeypatch, capsys):
    grid = {"block_size": (1 << 20,), "workers": (1, 2), "depth_per_worker": (2,)}
    monkeypatch.setattr(io_bench, "QUICK_GRID", grid)
    args = _parse(["io", "bench", "--quick", "--size-mib", "2", "--path", str(tmp_path / "bench")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "best: block_size=1048576" in out and "x raw" in out
    assert "io = IOConfig(block_size=1048576, queue_depth=" in out
    assert not list((tmp_path / "bench").iterdir())  # its files are removed


def test_io_without_subcommand_prints_usage(capsys):
    args = _parse(["io"])
    assert args.func(args) == 2
    assert "bench" in capsys.readouterr().out


def test_io_bench_refuses_a_bad_size(tmp_path, capsys):
    args = _parse(["io", "bench", "--size-mib", "-3", "--path", str(tmp_path)])
    assert args.func(args) == 2
    assert "--size-mib=-3 must be >= 1" in capsys.readouterr().out


@pytest.mark.parametrize("variant", ["memory", "cpu", "nvme"])
def test_benchmark_workload_variants_build(tmp_path, variant):
    import torch

    from plait.offload_io.benchmarks import workload

    model = torch.nn.Linear(8, 8)
    optimizer = workload.make_optimizer(variant, model, str(tmp_path))
    assert isinstance(optimizer, torch.optim.Optimizer)
    if hasattr(optimizer, "close"):
        optimizer.close()
    with pytest.raises(ValueError, match="unknown variant"):
        workload.make_optimizer("tape", model)
