"""The step-time breakdown (plait.zero_sharding.benchmarks.breakdown*): the profile's categories on a
real step, the PNG, the README table's rows equal to its rendering's from the committed results, and one
world-size-2 run of the worker at a tiny size (every contender trains the same batches: equal first
losses; plait ZeRO-3 moves FSDP2's bytes plus its control all-reduce)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from plait.kernels.bench import BenchRow, read_json
from plait.kernels.testing import run_distributed, tiny_llama
from plait.kernels.testing.readme_tables import assert_results_summary
from plait.zero_sharding.benchmarks import breakdown
from plait.zero_sharding.benchmarks.breakdown_worker import BreakdownJob, categorise, run_breakdown
from plait.zero_sharding.benchmarks.stacked_png import PALETTE, stacked_bars_png

PACKAGE = Path(__file__).resolve().parents[1]
RESULTS = PACKAGE / "benchmarks" / "results"


def test_categories_of_a_profiled_step() -> None:
    torch.manual_seed(0)
    model = tiny_llama(num_layers=1, vocab_size=64, hidden_size=32, num_heads=2, intermediate_size=64)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 64, (2, 8))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, \
            torch.profiler.record_function("breakdown::step"):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.zeros(1000).copy_(torch.ones(1000))  # a known copy of 1000 elements
        optimizer.step()
    out = categorise(prof.events())
    assert out["compute"] > 0 and out["optimizer"] > 0 and out["copies"] > 0
    assert out["copy_elements"] >= 1000 and out["copy_calls"] >= 1 and out["allocations"] >= 1
    named = sum(out[c] for c in breakdown.CATEGORIES if c != "other")
    assert named <= out["total"] and out["other"] == pytest.approx(out["total"] - named)


def _pixels(png: bytes) -> tuple[int, int, bytes]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    length = struct.unpack(">I", png[33:37])[0]
    assert png[37:41] == b"IDAT"
    return width, height, zlib.decompress(png[41:41 + length])


def test_png_stacks_the_segments(tmp_path: Path) -> None:
    path = stacked_bars_png(tmp_path / "bars.png", [[1.0, 1.0], [2.0, 0.0]], grid=1.0, width=40, height=30)
    width, height, raw = _pixels(path.read_bytes())
    assert (width, height) == (40, 30) and len(raw) == height * (1 + 3 * width)

    def at(x: int, y: int) -> tuple[int, ...]:
        row = raw[y * (1 + 3 * width) + 1:(y + 1) * (1 + 3 * width)]
        return tuple(row[3 * x:3 * x + 3])

    # 10 px for the tallest bar (2 units): rows 24-28 are the first unit, 19-23 the second.
    assert at(10, 26) == PALETTE[0] and at(10, 21) == PALETTE[1]  # first bar: two segments
    assert at(30, 21) == PALETTE[0] and at(30, 17) == (255, 255, 255)  # second: one segment, as tall
    with pytest.raises(ValueError, match="stacked_bars_png"):
        stacked_bars_png(tmp_path / "bad.png", [[-1.0]], grid=1.0)


def test_readme_table_is_the_rendering_of_the_committed_results() -> None:
    rows, meta = read_json(RESULTS / "zero-breakdown.json")
    readme = (PACKAGE / "README.md").read_text()
    block = readme.split("<!-- zero-breakdown:start -->\n", 1)[1].split("\n<!-- zero-breakdown:end -->", 1)[0]
    # the README shows selected rows; each is the rendering's row, verbatim and in order
    assert_results_summary(block, breakdown.render_markdown(rows, meta), "README zero-breakdown table")
    names = breakdown._contenders(rows)
    assert names == ["plait ZeRO-2", "plait ZeRO-3", "FSDP2", "DDP"]
    assert (RESULTS / "zero-breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_before_after_is_the_rendering_of_the_two_results_files() -> None:
    before, _ = read_json(RESULTS / "zero-breakdown-before.json")
    after, _ = read_json(RESULTS / "zero-breakdown.json")
    readme = (PACKAGE / "README.md").read_text()
    marker = "zero-breakdown-before-after"
    block = readme.split(f"<!-- {marker}:start -->\n", 1)[1].split(f"\n<!-- {marker}:end -->", 1)[0]
    assert block == breakdown.render_before_after(before, after, label="reduce-scatter in place")
    # The change removed one shard copy per resident unit and step: ZeRO-2 copies fewer elements.
    def copied(rows: list[BenchRow]) -> float:
        return next(r.ours for r in rows if r.peer == "plait ZeRO-2" and r.figure == "elements copied/step")

    assert copied(after) < copied(before)


def test_rows_name_a_contender_that_could_not_run() -> None:
    figures = {"wall": [0.2, 0.3], "thread_cpu": [0.1, 0.1], "background_cpu": [0.0, 0.0], "comm_wall_s": 0.01,
               "bytes": {"all_reduce": 8}, "loss": 1.0,
               "profile": dict.fromkeys(breakdown.CATEGORIES, 1e3) | {"total": 6e3, "allocations": 2,
                                                                      "copy_calls": 1, "copy_elements": 10}}
    rows = breakdown.rows_from({"errors": {"FSDP2": "RuntimeError: no"}, "DDP": figures,
                                "plait ZeRO-3": figures}, breakdown.QUICK)
    failed = [r for r in rows if r.peer == "FSDP2"]
    assert len(failed) == 1 and "could not run here" in failed[0].note
    wall = next(r for r in rows if r.peer == "plait ZeRO-3" and r.figure == "step wall (ms)")
    assert wall.ratio == pytest.approx(1.0) and "p10/median/p90" in wall.note
    assert breakdown._contenders(rows) == ["DDP", "plait ZeRO-3"]
    assert isinstance(rows[0], BenchRow)


def test_worker_at_two_ranks() -> None:
    names = ("plait ZeRO-3", "FSDP2")  # the other two share every code path but their builders
    job = BreakdownJob(model="tiny-llama-2l", batch=2, seq=8, warmup=1, rounds=1, profiled=1, contenders=names)
    result = run_distributed(run_breakdown, 2, job, timeout=240)[0]
    assert result["errors"] == {} and set(result) == {"errors", *names}
    losses = [result[name]["loss"] for name in names]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])  # same seed, same batches
    for name in names:
        assert len(result[name]["wall"]) == 2 and result[name]["profile"]["compute"] > 0
    zero3, fsdp = result["plait ZeRO-3"]["bytes"], result["FSDP2"]["bytes"]
    assert zero3["all_gather"] == fsdp["all_gather"] and zero3["reduce_scatter"] == fsdp["reduce_scatter"]
