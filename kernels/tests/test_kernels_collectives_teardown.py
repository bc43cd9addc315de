"""The last small collective of each group is kept by the caller, so no gloo worker frees it while
the interpreter shuts down (plait.kernels.collectives.teardown; the abort it prevents is in its
docstring). Checked: which works are kept, that blocking collectives still block, name failures
and return None, and that a four-rank run whose last act is a collective exits 0."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.collectives import teardown
from plait.kernels.testing import run_distributed

BIG = teardown.KEEP_MAX_BYTES // 4 + 1  # fp32 elements: one more than the kept limit


def _kept_after_each_collective() -> list[tuple[str, bool, bool]]:
    seen = []
    twin = dist.new_group([0, 1])
    small = torch.ones(8)
    assert collectives.all_reduce(small, name="small") is None  # blocking: returns None, as torch
    assert small.tolist() == [2.0] * 8  # and it has completed when it returns
    kept = teardown.kept()
    seen.append(("small", "world" in kept, kept["world"].is_completed() if "world" in kept else False))
    collectives.all_reduce(torch.ones(BIG), name="big")
    seen.append(("big", "world" in teardown.kept(), False))  # too big to keep: the small one is released
    collectives.broadcast(torch.ones(4), src=0, group=twin, async_op=True, name="async").wait()
    twin_label = collectives.ops.flight_group(twin)
    seen.append(("async on twin", twin_label in teardown.kept(), "world" in teardown.kept()))
    collectives.barrier(name="barrier")
    seen.append(("barrier", "world" in teardown.kept(), twin_label in teardown.kept()))
    return seen


def test_the_last_small_collective_of_each_group_is_kept():
    for seen in run_distributed(_kept_after_each_collective, 2, timeout=60):
        assert seen == [("small", True, True), ("big", False, False), ("async on twin", True, False),
                        ("barrier", True, True)]


JOB = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist
    from plait.kernels import collectives
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    payload = torch.arange(64, dtype=torch.uint8)
    for _ in range(20):
        collectives.broadcast(payload, src=0, name="last broadcast")
    dist.destroy_process_group()
    sys.exit(0)  # a normal exit through interpreter finalization, as a finished job's
""")


def test_runs_whose_last_act_is_a_broadcast_exit_zero(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    for run in range(3):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                               str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "terminate called" not in done.stderr, (run, done.stderr[-3000:])
