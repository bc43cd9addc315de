"""Preemption under Lightning's own launcher (``devices=2``) with PlaitStrategy ZeRO-3 and
``PreemptionCheckpoint``: SIGTERM saves a checkpoint, every rank exits 0, a restart resumes by itself.

``lightning_preemption_job.py`` runs three times as a user would (``python job.py``): straight
through 12 steps; with SIGTERM sent to rank 1 only at step 5 (the case Lightning alone does not
handle: it acts on rank 0's flag); and once more with no checkpoint given to ``fit()``. Checked:
both ranks stop after the same step and save one checkpoint together, into the Trainer's checkpoint
directory, next to (not over) the user's checkpoints, including a file already named
``preempted.ckpt``; both exit 0 and no process is left; the restarted job finds the checkpoint and
its losses at steps 6-11 are bit for bit those of the straight run, on both ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from plait.kernels.testing import live_processes_mentioning, run_in_session

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds leftover processes through /proc")

JOB = Path(__file__).with_name("lightning_preemption_job.py")
JOB_LIMIT_S = 90


def _run(outdir: Path, *args: str) -> tuple[int, str, float]:
    """Run the job; returns rank 0's exit code, its stderr, and when it exited (wall clock)."""
    run = run_in_session([sys.executable, str(JOB), args[0], str(outdir), *args[1:]], limit_s=JOB_LIMIT_S,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, keep="stderr")
    return run.rc, run.output, run.ended


def _losses(outdir: Path, mode: str, rank: int) -> dict[int, str]:
    lines = (outdir / f"losses-{mode}-rank{rank}.txt").read_text().split("\n")
    return {int(step): bits for step, bits in (line.split() for line in lines if line)}


def test_sigterm_on_one_rank_saves_exits_cleanly_and_resumes_bit_for_bit(tmp_path):
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    straight.mkdir()
    (preempted / "checkpoints").mkdir(parents=True)
    user_file = preempted / "checkpoints" / "preempted.ckpt"  # the user's, by bad luck of the same name
    user_file.write_bytes(b"the user's own checkpoint")

    code, err, _ = _run(straight, "straight")
    assert code == 0, err[-3000:]

    code, err, ended = _run(preempted, "preempt", "sigterm:rank=1:step=5")
    fault_at = float((preempted / "fault_time").read_text())
    exits = [json.loads((preempted / f"exit{rank}").read_text()) for rank in (0, 1)]
    print(f"preemption: SIGTERM to rank 1 -> checkpoint saved on every rank "
          f"{max(e['saved_at'] for e in exits) - fault_at:.2f} s later (the save itself "
          f"{max(e['save_s'] for e in exits):.2f} s), rank 0 exited {ended - fault_at:.1f} s after SIGTERM")
    assert code == 0, err[-3000:]
    assert exits[0]["children"] == [0]  # rank 1 exited 0 by itself, before rank 0
    assert live_processes_mentioning(str(preempted)) == []
    saved = preempted / "checkpoints" / "preempted-v1.ckpt"
    assert exits[0]["saved"] == exits[1]["saved"] == str(saved) and saved.is_dir()
    assert hashlib.sha256(user_file.read_bytes()).digest() == hashlib.sha256(b"the user's own checkpoint").digest()
    assert (preempted / "checkpoints" / "epoch=0-step=3.ckpt").is_dir()  # the user's ModelCheckpoint files stay
    assert exits[1]["signalled_at"] is not None and exits[0]["signalled_at"] is None  # only rank 1 was signalled
    assert max(_losses(preempted, "preempt", 0)) == max(_losses(preempted, "preempt", 1)) == 5  # same step
    assert f"preempted at step 6: checkpoint saved to {saved}" in err

    code, err, _ = _run(preempted, "resume")
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        resumed, reference = _losses(preempted, "resume", rank), _losses(straight, "straight", rank)
        assert sorted(resumed) == list(range(6, 12))
        assert resumed == {step: reference[step] for step in range(6, 12)}
    assert saved.is_dir()  # kept after the resumed run finished


def test_checkpoint_names_never_reuse_a_path(tmp_path):
    from plait.lightning import PreemptionCheckpoint
    from plait.lightning.preemption import _free_path

    assert PreemptionCheckpoint().ckpt_path == ""  # no directory yet: Lightning must not look in the cwd
    assert _free_path(str(tmp_path), "preempted") == str(tmp_path / "preempted.ckpt")
    (tmp_path / "preempted.ckpt").mkdir()
    (tmp_path / "preempted-v1.ckpt").write_text("user")
    assert _free_path(str(tmp_path), "preempted") == str(tmp_path / "preempted-v2.ckpt")
    (tmp_path / "preempted-vx.ckpt").write_text("not ours")
    os.utime(tmp_path / "preempted.ckpt", (1, 1))
    assert PreemptionCheckpoint(tmp_path).ckpt_path == str(tmp_path / "preempted-v1.ckpt")  # newest of its names
    (tmp_path / "preempted-v3.ckpt" / ".tmp-step-0000000005").mkdir(parents=True)  # a save SIGKILLed mid-way
    assert PreemptionCheckpoint(tmp_path).ckpt_path == str(tmp_path / "preempted-v1.ckpt")  # never resumed from
    with pytest.raises(ValueError, match="check_every_n_steps"):
        PreemptionCheckpoint(check_every_n_steps=0)
