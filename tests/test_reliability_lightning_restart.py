"""R9 with a restart under Lightning: ``torchrun --max-restarts 1`` and ``fit(ckpt_path="last")`` (Trainer),
or the newest ``fabric.save`` directory (Fabric, ``reliability_fabric_restart_job.py``).

``reliability_lightning_job.py`` is a Lightning Trainer job (``PlaitStrategy`` ZeRO-3, ``devices=2``,
a ``ModelCheckpoint`` every 3 steps with ``save_last="link"``) that calls
``trainer.fit(module, ckpt_path="last")``. Lightning's strategies join the process group with torch's
own ``init_process_group``, whose store keys are the same in every torchrun attempt; the plait
strategies join through ``collectives.init_process_group`` under torchrun, so a restarted attempt
only sees its own ranks. Under ``torchrun --standalone --nproc-per-node 2``:

* **straight**: 9 steps, no fault (the reference);
* **killed and restarted** (``--max-restarts 1``): rank 1 is SIGKILLed before step 4 of the first
  attempt; torchrun stops rank 0 and starts both again; Lightning finds ``last.ckpt`` (step 3) and
  both ranks resume there and finish; torchrun exits 0.

Checked: both ranks of the restart start from step 3; every loss after the resume is bit for bit
the straight run's (both ranks); the final checkpoints' consolidated weights are bitwise equal; no
process of the job is left (``/proc``); the work lost (steps redone, seconds of training from the
last commit to the kill) and the time from the kill to the resume are printed.
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
# One launch's limit (the whole session is SIGKILLed past it). The killed launch starts Lightning twice (the
# first attempt and torchrun's restart); each start imports Lightning afresh, which took 20-26 s of wall time at
# load 20-30 on two cores, so that launch took 71 s there: 100 s left too little margin.
LIMIT_S = 150
# kind -> (the job, where its final checkpoint is, what it is for the results table)
JOBS = {
    "trainer": (Path(__file__).with_name("reliability_lightning_job.py"), f"checkpoints/epoch=0-step={STEPS}.ckpt",
                "plait-lightning: Trainer, PlaitStrategy ZeRO-3, torchrun --max-restarts 1, fit(ckpt_path=\"last\")"),
    "fabric": (Path(__file__).with_name("reliability_fabric_restart_job.py"), f"ckpts/step-{STEPS}",
               "plait-lightning: Fabric, PlaitFabricStrategy ZeRO-3, torchrun --max-restarts 1, newest fabric.save"),
}


def _final_weights(outdir: Path, kind: str) -> dict[str, torch.Tensor]:
    from plait.lightning import consolidated_state_dict

    return consolidated_state_dict(outdir / JOBS[kind][1])


def _one(rows: list[dict], **match: object) -> dict:
    found = [row for row in rows if all(row.get(key) == value for key, value in match.items())]
    assert len(found) == 1, (match, rows)
    return found[0]


@pytest.mark.parametrize("kind", list(JOBS))
def test_a_killed_rank_is_restarted_and_resumes_from_last_bit_for_bit(tmp_path, kind):
    script, _, package = JOBS[kind]
    straight = tmp_path / "straight"
    straight.mkdir()
    job = run_job(straight, "none", steps=STEPS, save_every=SAVE_EVERY, job=script, limit_s=LIMIT_S)
    assert job.rc == 0, job.output[-4000:]

    outdir = tmp_path / "killed"
    outdir.mkdir()
    job = run_job(outdir, "kill:rank=1:step=4", steps=STEPS, save_every=SAVE_EVERY, max_restarts=1, job=script,
                  limit_s=LIMIT_S)
    left = live_processes_mentioning(str(outdir))
    assert job.rc == 0, job.output[-6000:]
    assert left == [] and not any(Path(f"/proc/{pid}").exists() for pid in pids(outdir)), left
    rank0, rank1 = events(outdir, 0), events(outdir, 1)
    kill = _one(rank1, event="fault", attempt=0)
    committed = _one(rank1, event="save", attempt=0, step=3)
    resumed = [_one(rows, event="start", attempt=1) for rows in (rank0, rank1)]
    assert [e["step"] for e in resumed] == [3, 3]
    assert [_one(rows, event="done", attempt=1)["step"] for rows in (rank0, rank1)] == [STEPS, STEPS]
    print(f"Lightning {kind} restart: rank 1 SIGKILLed before step 4; both resumed from step 3 "
          f"{max(e['time'] for e in resumed) - kill['time']:.1f} s later (torchrun restart + Lightning start); "
          f"work lost: {kill['step'] - committed['step']} step, {kill['time'] - committed['time']:.2f} s of training")
    for rank in (0, 1):
        reference, got = losses(straight, rank)[0], losses(outdir, rank)
        assert set(range(0, 4)) <= set(got[0]) <= set(range(0, 5))  # up to the kill (rank 0 may log step 4)
        assert got[0] == {step: reference[step] for step in got[0]}
        assert got[1] == {step: reference[step] for step in range(3, STEPS)}  # the restart
    want, got = _final_weights(straight, kind), _final_weights(outdir, kind)
    assert sorted(got) == sorted(want)
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
    record(package, "rank 1 of 2 SIGKILLed before step 4", named="by torchrun (exit code -9)", left=0,
           resumed_after_s=round(max(e["time"] for e in resumed) - kill["time"], 1),
           lost_steps=kill["step"] - committed["step"], lost_s=round(kill["time"] - committed["time"], 2), bitwise=True)
