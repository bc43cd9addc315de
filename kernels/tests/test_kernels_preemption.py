"""PreemptionGuard and the restart-safe init_process_group, on plait-kernels alone.

* SIGTERM to one rank of three: every rank's ``should_stop()`` turns True at the same step (the
  signalled rank's next check), with one named 4-byte all-reduce per check and none between checks
  (``check_every_n_steps=2``); compared with the reference answer "the first check at or after the
  signal", computed from the step each rank was signalled at.
* the grace timer: a process that ignores the stop ends itself ``grace_s`` after SIGTERM, exit
  code 128 + 15.
* ``collectives.init_process_group`` under torchrun's environment keeps each attempt's keys under
  ``plait/attempt-<n>/`` of the agent's store (the reason: a restarted rank must never read the
  previous attempt's addresses).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from plait.kernels import collectives
from plait.kernels.testing import run_distributed

SIGNAL_AT, EVERY, STEPS = 3, 2, 12


def _guarded_loop(signalled_rank: int) -> dict:
    import torch.distributed as dist

    guard = collectives.PreemptionGuard(check_every_n_steps=EVERY, grace_s=30.0).install()
    stopped_at = None
    with collectives.ByteLedger() as ledger:
        for step in range(STEPS):
            if step == SIGNAL_AT and dist.get_rank() == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
            if guard.should_stop():
                stopped_at = step
                break
    guard.uninstall()
    checks = [e.label for e in collectives.history() if e.label == collectives.preemption.CHECK_NAME]
    return {"stopped_at": stopped_at, "signalled": guard.signalled, "checks": len(checks),
            "bytes": [r.nbytes for r in ledger.records], "handler": signal.getsignal(signal.SIGTERM)}


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_check():
    results = run_distributed(_guarded_loop, 3, 1, timeout=60)
    # reference: the first check (every EVERY-th call: steps 1, 3, 5, ...) at or after the signal
    expected = next(step for step in range(SIGNAL_AT, STEPS) if (step + 1) % EVERY == 0)
    assert [r["stopped_at"] for r in results] == [expected] * 3
    assert [r["signalled"] for r in results] == [False, True, False]
    assert all(r["checks"] == (expected + 1) // EVERY for r in results)
    assert all(r["bytes"] == [4] * r["checks"] for r in results)  # one float32 per check, nothing else
    assert all(r["handler"] == signal.SIG_DFL for r in results)  # uninstall gave SIGTERM back


def _run_python(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_process_that_does_not_stop_ends_itself_after_the_grace_time():
    started = time.monotonic()
    done = _run_python("""
        import os, signal, time
        from plait.kernels.collectives import PreemptionGuard
        PreemptionGuard(grace_s=0.5).install()
        os.kill(os.getpid(), signal.SIGTERM)
        print("signalled", flush=True)
        time.sleep(20)   # stuck: never asks should_stop()
        print("not reached", flush=True)
    """)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout.split() == ["signalled"]
    assert "still running 0.5 s after signal 15 (PreemptionGuard grace_s)" in done.stderr
    assert time.monotonic() - started < 15


def test_init_process_group_keeps_each_torchrun_attempt_apart():
    from plait.kernels.testing import free_port

    port = free_port()
    done = _run_python(f"""
        import datetime
        import torch.distributed as dist
        from plait.kernels import collectives
        agent = dist.TCPStore("127.0.0.1", {port}, 1, is_master=True, timeout=datetime.timedelta(seconds=20))
        agent.set("default_pg/0//cpu//rank_0", "a stale address")   # what an earlier attempt left
        collectives.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
        print(collectives.restart_count(), *sorted(agent.list_keys()))
        dist.destroy_process_group()
    """, env={"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    count, *keys = done.stdout.split()
    assert count == "2"
    fresh = [key for key in keys if key != "default_pg/0//cpu//rank_0"]
    assert fresh and all(key.startswith("plait/attempt-2/") for key in fresh), keys
    with pytest.raises(ValueError, match=r"rank=\.\.\.\) is set from torchrun's environment"):
        collectives.init_process_group("gloo", timeout=None, rank=0)
