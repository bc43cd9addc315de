"""Smoke tests of the paired benchmark's pieces (plait.zero_sharding.benchmarks.paired_*): the job's
validation, the storage accounting, the rows' targets, and one world-size-2 counted step of plait
ZeRO-3 beside FSDP2 (DeepSpeed is left to the suite itself: its start-up alone takes tens of seconds)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.kernels.bench import TimingStats
from plait.kernels.collectives import count_torch_distributed
from plait.kernels.testing import run_distributed
from plait.zero_sharding.benchmarks import paired_setup, paired_suite, paired_worker
from plait.zero_sharding.benchmarks.paired_setup import PairedJob, state_storage_bytes


@pytest.mark.parametrize("bad", [dict(model="gpt"), dict(model="tiny-llama", dtype="fp8"),
                                 dict(model="tiny-llama", stages=(0,)), dict(model="tiny-llama", stages=()),
                                 dict(model="tiny-llama", steps=0)])
def test_job_refuses_bad_fields(bad: dict) -> None:
    with pytest.raises(ValueError, match="PairedJob"):
        PairedJob(**bad)


def test_storage_bytes_counts_each_storage_once() -> None:
    flat = torch.zeros(100)
    a, b = flat[:40], flat[40:]  # two views of one storage: 400 bytes
    param = torch.nn.Parameter(torch.zeros(10))
    param.grad = torch.zeros(10)
    state = {"exp_avg": torch.zeros(5, dtype=torch.float64), "alias": a}
    assert state_storage_bytes([a, b], param, state) == 400 + 40 + 40 + 40
    freed = torch.zeros(8)
    freed.untyped_storage().resize_(0)  # a released gather counts nothing
    assert state_storage_bytes(freed) == 0


def test_mlp_has_about_fifty_million_parameters() -> None:
    model = paired_setup.ResidualFreeMLP(width=64, depth=3)
    assert sum(p.numel() for p in model.parameters()) == 3 * (64 * 64 + 64)
    width, depth = paired_setup.MLP_WIDTH, paired_setup.MLP_DEPTH
    assert 49e6 < depth * (width * width + width) < 51e6


def _figures(volume: int, memory: int, expected_volume: int) -> dict:
    return {"volume": volume, "by_op": {"all_gather": volume}, "memory": memory, "loss": 1.0,
            "first_loss": 2.0,
            "model_state": {"total": memory}, "breakdown": None,
            "expected": {"volume": expected_volume, "psi": 1000, "padding": 0, "root": 0}}


def test_rows_hold_plait_to_the_exact_bytes_and_the_memory_formula() -> None:
    exact = 2 * 1000 * 4 + 32
    good = {"figures": {"plait ZeRO-2": _figures(exact, 8000, exact)}, "errors": {"DeepSpeed ZeRO-2": "boom"},
            "timings": {}}
    byte_rows = paired_suite.byte_rows("t", 2, "float32", good)
    assert byte_rows[0].passed is True and byte_rows[1].passed is None and "boom" in byte_rows[1].note
    off = {**good, "figures": {"plait ZeRO-2": _figures(exact + 4, 8000, exact)}}
    assert paired_suite.byte_rows("t", 2, "float32", off)[0].passed is False
    # stage 2, Psi=1000, W=2, fp32 AdamW: 4 Psi + (4 + 8) Psi / 2 = 10000 bytes
    memory = paired_suite.memory_rows("t", 2, "float32", 2, [good, good])
    assert memory[0].peer_value == 10000 and memory[0].passed is False  # 8000 is 20% off
    on = {**good, "figures": {"plait ZeRO-2": _figures(exact, 10100, exact)}}
    assert paired_suite.memory_rows("t", 2, "float32", 2, [on])[0].passed is True


def test_time_rows_compare_with_each_peer_and_report_missing_ones() -> None:
    fast, slow = TimingStats.of([1.0] * 10), TimingStats.of([2.0] * 10)
    result = {"timings": {"plait ZeRO-3": fast, "FSDP2": slow}, "errors": {"DeepSpeed ZeRO-3": "no CPU op"},
              "figures": {"plait ZeRO-3": _figures(1, 1, 1), "FSDP2": _figures(1, 1, 1)}}
    rows = {row.peer: row for row in paired_suite.time_rows("t", 3, result)}
    assert rows["FSDP2"].ratio == pytest.approx(0.5) and rows["FSDP2"].passed is True
    assert rows["DeepSpeed ZeRO-3"].passed is None and "no CPU op" in rows["DeepSpeed ZeRO-3"].note


def test_quick_jobs_cover_every_stage_timed_and_stage_three_at_world_four() -> None:
    jobs = paired_suite.jobs(quick=True)
    assert [(w, j.timed, j.stages) for w, j in jobs] == [(2, True, (1, 2, 3)), (4, False, (3,))]
    assert all(j.steps >= 10 and j.warmup >= 1 for _, j in jobs if j.timed)


def _rank_stage3_beside_fsdp2() -> dict:
    torch.set_num_threads(1)
    job = PairedJob(model="tiny-llama-2l", stages=(3,), timed=False, batch=4, seq=16, warmup=1)
    out = {}
    with count_torch_distributed():
        for contender in (paired_setup.plait_zero(job, 3), paired_setup.fsdp2(job)):
            contender.zero_grad()
            contender.train(paired_setup.batch_for(job, 0))
            out[contender.name] = paired_worker._count_step(contender, job, 1)
    out["world"] = dist.get_world_size()
    return out


@pytest.mark.timeout(150)
def test_counted_step_of_plait_and_fsdp2_meets_the_targets() -> None:
    for result in run_distributed(_rank_stage3_beside_fsdp2, 2, timeout=120):
        ours, fsdp = result["plait ZeRO-3"], result["FSDP2"]
        assert ours["volume"] == ours["expected"]["volume"]
        assert ours["loss"] == pytest.approx(fsdp["loss"], rel=1e-4)  # same weights, data and optimizer
        per_rank = {"figures": {"plait ZeRO-3": ours, "FSDP2": fsdp}, "errors": {}, "timings": {}}
        rows = paired_suite.memory_rows("t", 3, "float32", result["world"], [per_rank])
        assert [row.passed for row in rows if row.target] == [True, True], rows


def test_markdown_summary_has_one_line_per_setup_and_stage() -> None:
    exact = 2 * 1000 * 4 + 32
    result = {"figures": {"plait ZeRO-2": _figures(exact, 10000, exact)}, "errors": {"DeepSpeed ZeRO-2": "x"},
              "timings": {}}
    rows = paired_suite.byte_rows("m fp32 W=2", 2, "float32", result)
    rows += paired_suite.memory_rows("m fp32 W=2", 2, "float32", 2, [result])
    table = paired_suite.markdown_summary(rows).splitlines()
    assert len(table) == 3 and table[2].startswith("| m fp32 W=2 | 2 |")
    assert "1.000x ok" in table[2] and "n/a" in table[2]
