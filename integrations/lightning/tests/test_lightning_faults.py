"""R8 under Lightning's own launcher (``devices=2``) with PlaitStrategy (and Fabric with
PlaitFabricStrategy): no orphans, the rank named.

Each test runs ``lightning_fault_job.py`` as a user would (``python job.py``; rank 0 starts rank 1
by re-running the script) with one injected fault, and checks that every process is gone soon
after the fault, that rank 0 exits non-zero, and what its error says. The collective timeout is
30 s because it also bounds start-up: rank 0's store waits that long for rank 1 to connect, and
rank 1 first imports Lightning from scratch (Lightning imports torchmetrics, which imports
transformers where it is installed): 24 s of wall time at load 18 on two cores, which broke the
join at 15 s ("1/2 clients joined", seen at load 23-30). Each test allows the job 120 s in all (a hang
test took 85 s at load 30: two Lightning imports one after the other, then the 30 s timeout) and
kills its whole process group if it runs longer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

from plait.kernels.testing import run_in_session
from plait.lightning import failures

JOB = Path(__file__).with_name("lightning_fault_job.py")
TIMEOUT_S = 30
TEARDOWN_S = 60  # a busy machine's process teardown after the timeout (the bound is about not waiting forever)
JOB_LIMIT_S = 120


def _run_job(fault: str, outdir: Path, kind: str = "plait") -> tuple[int, str, float]:
    """Run the job; returns rank 0's exit code, its stderr, and when it exited (wall clock)."""
    run = run_in_session([sys.executable, str(JOB), fault, str(TIMEOUT_S), str(outdir), kind], limit_s=JOB_LIMIT_S,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, keep="stderr")
    return run.rc, run.output, run.ended


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not), from ``/proc``: the
    distribution alone does not install psutil."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids(outdir: Path) -> list[int]:
    return [int((outdir / f"pid{rank}").read_text()) for rank in (0, 1)]


def test_rank_one_hangs_rank_zero_names_it_and_nothing_is_left(tmp_path):
    code, err, ended = _run_job("hang:rank=1:step=3:seconds=600", tmp_path)
    fault_at = float((tmp_path / "fault_time").read_text())
    assert code != 0
    assert not any(_alive(pid) for pid in _pids(tmp_path)), err[-3000:]
    assert ended - fault_at < TIMEOUT_S + TEARDOWN_S
    assert "CollectiveError: rank 1 did not enter ZeRO" in err and "(step 3;" in err, err[-3000:]
    assert "its last collective was ZeRO" in err
    assert "stopped the ranks it launched: local rank 1" in err and "exit code -9" in err


def test_rank_zero_raises_and_rank_one_does_not_outlive_it(tmp_path):
    code, err, ended = _run_job("raise:rank=0:step=3", tmp_path)
    fault_at = float((tmp_path / "fault_time").read_text())
    assert code != 0 and "InjectedFaultError" in err
    assert not any(_alive(pid) for pid in _pids(tmp_path)), err[-3000:]
    assert ended - fault_at < TIMEOUT_S  # rank 1 was killed, not left waiting for its timeout (any load)
    assert "stopped the ranks it launched: local rank 1" in err and "exit code -9" in err


def test_fabric_rank_one_hangs_rank_zero_names_it_and_nothing_is_left(tmp_path):
    # Fabric has no exception hook: rank 0 stops the ranks it launched when its interpreter exits.
    code, err, ended = _run_job("hang:rank=1:step=3:seconds=600", tmp_path, "fabric")
    fault_at = float((tmp_path / "fault_time").read_text())
    assert code != 0
    assert not any(_alive(pid) for pid in _pids(tmp_path)), err[-3000:]
    assert ended - fault_at < TIMEOUT_S + TEARDOWN_S
    assert "CollectiveError: rank 1 did not enter ZeRO" in err, err[-3000:]
    assert "stopped the ranks it launched: local rank 1" in err and "exit code -9" in err


def test_a_finished_run_exits_0_names_the_slow_rank_and_waits_for_rank_one(tmp_path):
    # Rank 1 is 50 ms late at every step (the summary at the end of fit must name it) and still
    # works for 2 s after fit returns: rank 0's exit must neither kill it (its parent-death
    # guard) nor leave it behind.
    code, err, _ = _run_job("slow:rank=1:step=0:seconds=0.05", tmp_path)
    assert code == 0, err[-3000:]
    assert "plait: rank 1 is the one the others wait on most" in err, err[-3000:]
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()
    assert "stopped the ranks" not in err and not any(_alive(pid) for pid in _pids(tmp_path))


def test_rank_zero_sigkilled_takes_rank_one_with_it(tmp_path):
    # Rank 0 gets no chance to run Python: only rank 1's parent-death guard can end it.
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, str(JOB), "hang:rank=1:step=3:seconds=600", "60", str(tmp_path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + JOB_LIMIT_S - 5
        while not (tmp_path / "fault_time").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (tmp_path / "fault_time").exists(), "the job never reached the fault"
        rank0, rank1 = _pids(tmp_path)
        os.kill(rank0, signal.SIGKILL)
        proc.wait(timeout=5)
        gone_by = time.monotonic() + 3
        while _alive(rank1) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not _alive(rank1)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the job's process group
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_guards_act_only_for_their_launcher(monkeypatch, capsys):
    monkeypatch.setenv(failures.LAUNCHER_PID, str(os.getppid()))
    assert failures.launcher_pid() == os.getppid()
    monkeypatch.setenv(failures.LAUNCHER_PID, str(os.getpid()))  # not this process's parent
    assert failures.launcher_pid() is None and not failures.die_with_launcher()
    monkeypatch.delenv(failures.LAUNCHER_PID)
    assert failures.launcher_pid() is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    codes = failures.stop_launched_ranks(types.SimpleNamespace(procs=[child]), RuntimeError("boom"))
    assert codes == {1: -signal.SIGKILL} and not _alive(child.pid)
    said = capsys.readouterr().err  # the error first: Lightning's observer may kill rank 0 before its traceback
    assert said.index("rank 0 ended with RuntimeError: boom") < said.index("stopped the ranks it launched")
    assert failures.stop_launched_ranks(types.SimpleNamespace(), None) == {}  # nothing launched: no-op
