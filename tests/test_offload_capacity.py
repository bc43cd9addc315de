"""The capacity benchmark's machinery (``plait.offload_io.benchmarks.capacity``) on a small
decoder: each variant climbs the depth ladder under a cap, a cgroup cap kills a process that
does not fit, and the rows report the largest model with its peak and losses."""

from __future__ import annotations

import math

import pytest

from plait.offload_io.benchmarks import capacity

SHAPE = dict(vocab_size=512, hidden_size=128, num_heads=2, intermediate_size=256, max_seq_len=256)


@pytest.mark.timeout(300)
def test_capacity_rows_on_a_small_family(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(capacity, "QUICK_SHAPE", SHAPE)
    monkeypatch.setattr(capacity, "QUICK_LADDER", (1, 2))
    monkeypatch.setattr(capacity, "QUICK_CAP_BYTES", 2 << 30)
    monkeypatch.setenv("PLAIT_OFFLOAD_BENCH_DIR", str(tmp_path))
    rows = capacity.run(True)
    largest = [r for r in rows if r.figure == "largest model (M params)"]
    assert [r.benchmark.split(": ", 1)[1] for r in largest] == [capacity.LABELS[v] for v in capacity.VARIANTS]
    for row in largest:  # 2 GiB holds the 2-layer model in every variant
        assert row.ours > 0 and "2 layers" in row.note and "losses" in row.note, row
    ratio = next(r for r in rows if r.figure == "peak RSS (GiB)")
    assert ratio.ratio == pytest.approx(ratio.ours / ratio.peer_value) and ratio.passed is False
    step = next(r for r in rows if r.figure == "time (s)")
    assert step.ours > 0 and math.isfinite(step.ratio)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not capacity._cgroup_available(), reason="needs root and a cgroup v1 memory controller")
def test_a_cgroup_cap_stops_a_model_that_does_not_fit(tmp_path) -> None:
    assert capacity._try("memory", 1, SHAPE, str(tmp_path), 64 << 20) is None
    fitted = capacity._try("memory", 1, SHAPE, str(tmp_path), 2 << 30)
    assert fitted is not None and fitted["falling"] and fitted["peak_rss"] < 2 << 30
