"""The distributed test harness: results, failures, skips and hangs come back named."""

import time

import pytest
import torch
import torch.distributed as dist

from plait.kernels.testing.distributed import (
    DistributedTestError,
    DistributedTimeoutError,
    run_distributed,
)


def _sum_of_ranks() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise KeyError("boom on one")
    dist.barrier()  # rank 0 waits in a collective that never completes


def _hang_on_rank_one() -> None:
    if dist.get_rank() == 1:
        _sleep_forever()
    dist.barrier()


def _sleep_forever() -> None:
    while True:
        time.sleep(0.1)


def _store_used_after_rank_zero_is_done() -> int:
    # rank 0 has nothing to do; rank 1 still talks to the store rank 0 hosts (as a slow rank's
    # subgroup creation does) after rank 0 has returned
    if dist.get_rank() == 1:
        time.sleep(1.0)
        store = dist.distributed_c10d._get_default_store()
        store.set("late", b"1")
        return int(store.get("late") == b"1")
    return 0


def _skip_everywhere() -> None:
    pytest.skip("not on this machine")


def _env_value() -> str:
    import os

    return os.environ.get("PLAIT_HARNESS_PROBE", "")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_per_rank(world_size):
    results = run_distributed(_sum_of_ranks, world_size, timeout=60)
    expected_sum = float(sum(range(world_size)))
    assert results == [(rank, world_size, expected_sum) for rank in range(world_size)]


def test_a_failing_rank_is_named_and_others_do_not_hang():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)failed on rank 1 of 2.*KeyError: 'boom on one'"):
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 45


def test_a_hanging_rank_fails_within_timeout_and_is_named():
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_on_rank_one, 2, timeout=8)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank(s) [0, 1] still running" in message or "rank(s) [1]" in message
    assert "_sleep_forever" in message  # the stuck rank's stack names where it was
    assert elapsed < 8 + 60  # the timeout, then stack dumps and teardown on a busy machine; not forever


def test_a_rank_done_early_does_not_take_the_store_from_a_slower_one():
    # rank 0 hosts the store: before it waited for the others, its early exit reset rank 1's
    # connection ("Connection reset by peer", seen in CI when a 4-rank test built subgroups)
    assert run_distributed(_store_used_after_rank_zero_is_done, 2, timeout=60) == [0, 1]


def test_skips_are_carried_back():
    with pytest.raises(pytest.skip.Exception, match="not on this machine"):
        run_distributed(_skip_everywhere, 2, timeout=60)


def test_environment_reaches_the_ranks(monkeypatch):
    monkeypatch.setenv("PLAIT_HARNESS_PROBE", "seen")
    assert run_distributed(_env_value, 2, timeout=60) == ["seen", "seen"]


def test_local_functions_are_refused_with_a_fix():
    def local():
        return 1

    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(local, 1)


def _modules_present_before_the_function_imports_them() -> list[str]:
    import sys

    return [name for name in ("transformers.models.llama.modeling_llama", "lightning.pytorch") if name in sys.modules]


def test_ranks_start_with_the_heavy_optional_modules_already_imported():
    from plait.kernels.testing import preload

    # What the forkserver imported is what every rank starts with, so no rank pays those imports.
    present = run_distributed(_modules_present_before_the_function_imports_them, 2, timeout=120)
    expected = [name for name in ("transformers.models.llama.modeling_llama", "lightning.pytorch")
                if name in preload.LOADED]
    assert present == [expected, expected]
    # torch._dynamo is preloaded in every environment (the compile tests' ranks import it; without
    # transformers or Lightning nothing else loads it before a rank, plait's modules included).
    assert preload.LOADED[0] == "torch._dynamo"


def test_a_preload_that_fails_is_skipped_not_raised(tmp_path, monkeypatch):
    from plait.kernels.testing import preload

    (tmp_path / "plait_broken_preload_probe.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preload._load(("plait_broken_preload_probe", "plait_no_such_module_probe", "json")) == ["json"]
