"""A peer that cannot run (DeepSpeed's CPU Adam op not built) shows n/a and the reason; our own
figures in those rows are still measured; nothing reads as a measured 0."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from plait.kernels.bench import TimingStats, format_table
from plait.offload_io.benchmarks import suite, workload

REASON = "DeepSpeed's cpu_adam op is not built (test)"


def test_peer_row_without_the_peer_keeps_ours_and_says_why() -> None:
    row = suite.peer_row("step", TimingStats.of([0.002, 0.003, 0.004]), "DeepSpeedCPUAdam", None, REASON,
                         target_ratio=1.0)
    assert row.ours == pytest.approx(3.0) and row.peer_value is None and row.passed is None
    assert row.note == f"peer n/a: {REASON}"
    assert "n/a" in format_table([row])


def test_not_run_row_is_never_a_zero() -> None:
    row = suite.not_run_row("train step, ZeRO-Infinity", "needs plait-zero-sharding")
    assert math.isnan(row.ours) and row.note == "not run: needs plait-zero-sharding"


@pytest.mark.timeout(240)
def test_step_rows_without_deepspeed_cpu_adam(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.kernels.testing import tiny_llama

    def small_model(seed: int = 0):
        import torch

        torch.manual_seed(seed)
        return tiny_llama(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)

    monkeypatch.setattr(workload, "build_model", small_model)
    monkeypatch.setattr(workload, "deepspeed_cpu_adam_ready", lambda: (False, REASON))
    import torch.distributed as dist

    try:
        rows = suite._step_rows(str(tmp_path), quick=True)  # the ZeRO-3 rows start a one-process group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert all(row.ours != 0 for row in rows), [r for r in rows if r.ours == 0]
    peerless = [row for row in rows if "DeepSpeed" in row.peer]
    # a row whose own side needs a package this environment lacks says that instead (installed alone)
    assert peerless and all(row.peer_value is None and (REASON in row.note or row.note.startswith("not run: needs"))
                            for row in peerless), [r.note for r in peerless]
    measured = [row for row in peerless if not row.note.startswith("not run")]
    assert any("CPU memory (ours)" in row.benchmark for row in measured)
    assert all(row.ours > 0 for row in measured)  # ours measured although the peer could not run
    if workload.zero_infinity_available()[0]:  # plait's ZeRO-3 CPU offload row no longer waits for DeepSpeed
        assert any("ZeRO-3 (1 process)" in row.benchmark and row.ours > 0 for row in measured)
