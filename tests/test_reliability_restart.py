"""R9 with a restart, and preemption, for a plain ``torchrun`` loop: nothing lost, nothing left behind.

``reliability_restart_job.py`` is a ZeRO-3 loop (plait.zero_sharding) that resumes by itself from
the newest universal checkpoint (``CheckpointManager.restore``), saves every 3 steps, stops every
rank together on SIGTERM (``collectives.PreemptionGuard``) and joins its process group with
``collectives.init_process_group`` (restart-safe). Under ``torchrun --standalone --nproc-per-node 2``:

* **straight**: 9 steps, no fault (the reference);
* **killed, restarted, then preempted** (``--max-restarts 1``): rank 1 is SIGKILLed before step 4
  of the first attempt; torchrun stops rank 0 and starts both again; they resume from the step-3
  checkpoint; in that restart rank 0 alone gets SIGTERM before step 6: both ranks finish step 6,
  save step 7's checkpoint together and exit 0, and so does torchrun;
* **relaunched**: the same command again resumes from step 7 and finishes.

Checked: every loss after each resume is bit for bit the straight run's (both ranks), the final
checkpoints hold bitwise equal consolidated weights and optimizer state, no process of the job is
left after each launch (``/proc``), and the work lost per failure (steps redone, seconds from the
last commit to the fault) is printed. One scenario instead of three keeps it to four launches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_jobs import events, live_processes_mentioning, losses, pids, record, run_job

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds leftover processes through /proc")

STEPS, SAVE_EVERY = 9, 3


def _consolidated(root: Path) -> dict[str, torch.Tensor]:
    import plait.universal_ckpt as uc

    ckpt = uc.latest(root)
    manifest = uc.read_manifest(ckpt)
    return {name: uc.read_full(ckpt, manifest, entry) for name, entry in manifest.tensors.items()}


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert different == [], different


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("straight")
    job = run_job(outdir, "none", steps=STEPS, save_every=SAVE_EVERY)
    assert job.rc == 0, job.output[-4000:]
    return outdir


def _one(rows: list[dict], **match: object) -> dict:
    found = [row for row in rows if all(row.get(key) == value for key, value in match.items())]
    assert len(found) == 1, (match, rows)
    return found[0]


def _assert_losses_like(got: dict[int, str], reference: dict[int, str], steps: range) -> None:
    assert sorted(got) == list(steps)
    assert got == {step: reference[step] for step in steps}


def test_killed_restarted_preempted_and_relaunched_runs_lose_nothing(tmp_path, straight):
    outdir = tmp_path / "faulty-job"
    outdir.mkdir()
    job = run_job(outdir, "kill:rank=1:step=4,sigterm:rank=0:step=6@1", steps=STEPS, save_every=SAVE_EVERY,
                  max_restarts=1)
    left = live_processes_mentioning(str(outdir))
    assert job.rc == 0, job.output[-6000:]
    assert left == [] and not any(Path(f"/proc/{pid}").exists() for pid in pids(outdir)), left
    rank0, rank1 = events(outdir, 0), events(outdir, 1)
    kill, sigterm = _one(rank1, event="fault", attempt=0), _one(rank0, event="fault", attempt=1)
    committed = _one(rank1, event="save", attempt=0, step=3)
    resumed = [_one(rows, event="resume", attempt=1) for rows in (rank0, rank1)]
    stops = [_one(rows, event="preempted") for rows in (rank0, rank1)]
    print(f"restart: rank 1 SIGKILLed before step 4; both resumed from step {resumed[1]['step']} "
          f"{resumed[1]['time'] - kill['time']:.1f} s later; work lost: {kill['step'] - committed['step']} step, "
          f"{kill['time'] - committed['time']:.2f} s of training")
    print(f"preemption: SIGTERM to rank 0 before step 6 -> step {stops[0]['step']}'s checkpoint committed on both "
          f"ranks {max(e['time'] for e in stops) - sigterm['time']:.2f} s later; torchrun exited 0 "
          f"{job.ended - sigterm['time']:.1f} s after SIGTERM; nothing left")
    assert [e["step"] for e in resumed] == [3, 3]
    assert [e["step"] for e in stops] == [7, 7]  # both finished step 6 and stopped there together
    assert stops[0]["signalled_at"] is not None and stops[1]["signalled_at"] is None  # rank 1 learned it
    assert not any(e["event"] == "done" for e in rank0 + rank1)

    first = outdir / "first-launch"
    first.mkdir()
    for rank in (0, 1):  # the relaunch is torchrun's attempt 0 again: keep its losses apart
        (outdir / f"losses-rank{rank}.txt").rename(first / f"losses-rank{rank}.txt")
    again = run_job(outdir, "none", steps=STEPS, save_every=SAVE_EVERY)
    assert again.rc == 0, again.output[-4000:]
    assert live_processes_mentioning(str(outdir)) == []
    assert [e["step"] for e in events(outdir, 0) if e["event"] == "resume"] == [3, 7]
    for rank in (0, 1):
        reference, before = losses(straight, rank)[0], losses(first, rank)
        _assert_losses_like(before[0], reference, range(0, 4))  # up to the kill
        _assert_losses_like(before[1], reference, range(3, 7))  # the restart, up to the preemption
        _assert_losses_like(losses(outdir, rank)[0], reference, range(7, STEPS))  # the relaunch
    _assert_same_tensors(_consolidated(outdir / "ckpt"), _consolidated(straight / "ckpt"))
    loop = "zero-sharding ZeRO-3: torchrun loop, --max-restarts 1, CheckpointManager.restore"
    record(loop, "rank 1 of 2 SIGKILLed before step 4", named="by torchrun (exit code -9)", left=0,
           resumed_after_s=round(resumed[1]["time"] - kill["time"], 1), lost_steps=kill["step"] - committed["step"],
           lost_s=round(kill["time"] - committed["time"], 2), bitwise=True)
    to_checkpoint = max(e["time"] for e in stops) - sigterm["time"]
    one_save = max(e["save_s"] for e in rank0 + rank1 if e["event"] == "save")  # a whole save, as async would take
    print(f"preemption to committed checkpoint {to_checkpoint:.2f} s = {to_checkpoint / one_save:.1f}x one whole "
          f"save ({one_save:.2f} s; it includes finishing the step in flight)")
    record(loop, "SIGTERM to rank 0 of 2 before step 6 (preemption)", left=0, lost_steps=0,
           checkpoint_after_s=round(to_checkpoint, 2), one_save_s=round(one_save, 2),
           exit_after_s=round(job.ended - sigterm["time"], 1), bitwise=True)


def test_a_guard_checks_its_arguments():
    from plait.kernels.collectives import PreemptionGuard

    for bad, field in (({"check_every_n_steps": 0}, "check_every_n_steps"), ({"signals": ()}, "signals"),
                       ({"grace_s": 0}, "grace_s")):
        with pytest.raises(ValueError, match=field):
            PreemptionGuard(**bad)
