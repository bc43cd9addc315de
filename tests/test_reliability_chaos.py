"""The chaos campaign: training jobs under random faults, restarted until they finish, end with
the uninterrupted run's weights bit for bit.

``plait.kernels.testing.chaos`` draws the faults (seeded: kind, rank, step) and drives the jobs;
each job is ``reliability_restart_job.py`` under ``torchrun --standalone --nproc-per-node 2`` in
one of the strategy setups of docs/reliability.md (``VARIANTS``) or one of the routes of
``reliability_routes.py`` (1-bit Adam, Ulysses ``sp_size=2``, experts at ``ep_size=2``). A killed,
hung or disk-full rank, or one that damaged the newest checkpoint before dying, ends the launch's
workers and torchrun's ``--max-restarts`` starts them again (after damage, from the checkpoint
before the damaged one); a SIGTERM makes every rank save and exit 0 and the driver launches the job
again (a requeue); a slow rank restarts nothing.

The CI campaign injects 20 faults into the three routes (several faults per job, so few launches;
the ZeRO setups' restarts have their own tests). ``PLAIT_CHAOS_FAULTS=100 PLAIT_CHAOS_SETUPS=all``
runs the long campaign (every setup and route, hangs included);
``python tests/reliability_report.py run tests/test_reliability_chaos.py`` with those variables
records its figures into the results file behind docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_jobs import live_processes_mentioning, record, run_job
from reliability_restart_job import VARIANTS
from reliability_routes import ROUTES

from plait.kernels.testing.chaos import ChaosConfig, run_campaign, summarize

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds leftover processes through /proc")

FAULTS = int(os.environ.get("PLAIT_CHAOS_FAULTS", "20"))
LONG = os.environ.get("PLAIT_CHAOS_SETUPS") == "all"
SETUPS = (*VARIANTS, *ROUTES) if LONG else tuple(ROUTES)
KINDS = ("kill", "diskfull", "damaged", "sigterm", "slow", *(("hang",) if LONG else ()))
# PLAIT_CHAOS_JOBS: jobs side by side (the long campaign runs 3: its hangs and restarts mostly wait).
CONFIG = ChaosConfig(seed=int(os.environ.get("PLAIT_CHAOS_SEED", "0")), faults=FAULTS, faults_per_job=5,
                     kinds=KINDS, steps=9, save_every=3, jobs_at_once=int(os.environ.get("PLAIT_CHAOS_JOBS", "2")))


class TorchrunJob:
    """``reliability_restart_job.py`` in one setup, as :class:`~plait.kernels.testing.chaos.ChaosJob`."""

    def __init__(self, variant: str) -> None:
        self.variant = variant

    def launch(self, outdir: Path, faults: str, max_restarts: int) -> int:
        limit = 180.0 + 90.0 * max_restarts  # generous: each restart re-imports torch on a loaded machine
        job = run_job(outdir, faults, steps=CONFIG.steps, save_every=CONFIG.save_every,
                      max_restarts=max_restarts, stage=self.variant, limit_s=limit)
        return job.rc

    def weights(self, outdir: Path) -> dict[str, torch.Tensor]:
        import plait.universal_ckpt as uc

        ckpt = uc.latest(outdir / "ckpt")
        manifest = uc.read_manifest(ckpt)
        return {name: uc.read_full(ckpt, manifest, entry) for name, entry in manifest.tensors.items()}

    def events(self, outdir: Path) -> list[dict[str, Any]]:
        rows = [json.loads(line) for path in sorted(outdir.glob("events-rank*.jsonl"))
                for line in path.read_text().splitlines()]
        return sorted(rows, key=lambda row: row["time"])


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.timeout(7200 if LONG else 1200)  # dozens of torchrun launches; a busy machine multiplies each
def test_chaos_campaign_recovers_every_fault_bitwise(tmp_path: Path) -> None:
    jobs = {variant: TorchrunJob(variant) for variant in SETUPS}

    def reference(variant: str) -> dict[str, torch.Tensor]:  # run_campaign asks once per setup
        outdir = tmp_path / f"straight-{variant}"
        outdir.mkdir()
        assert jobs[variant].launch(outdir, "none", 0) == 0
        return jobs[variant].weights(outdir)

    records = run_campaign(CONFIG, jobs, tmp_path / "jobs", reference, _same)
    summary = summarize(records)
    print("chaos campaign:", json.dumps(summary))
    for row in records:
        print(f"  {row.setup:9s} {row.kind:8s} rank {row.rank} step {row.step}: recovered={row.recovered} "
              f"lost {row.steps_lost} steps, {row.seconds_lost:.1f} s")
    kinds = ", ".join(f"{n} {k}" for k, n in summary["kinds"].items())
    record(f"chaos campaign ({'long' if LONG else 'CI'}, seed {CONFIG.seed})",
           f"{summary['faults']} random faults ({kinds}) in setups {', '.join(summary['setups'])}, "
           f"{CONFIG.jobs_at_once} jobs at a time",
           chaos=summary, bitwise=summary["recovered"] == summary["faults"],
           lost_steps=summary["steps_lost_median"], lost_s=summary["seconds_lost_median"])
    assert len(records) == FAULTS and {r.kind for r in records} <= set(KINDS)
    assert summary["recovered"] == FAULTS, [r for r in records if not r.recovered]
    # A damaged newest checkpoint costs at most one save interval more than a kill, and is never loaded.
    assert all(r.steps_lost < (2 * CONFIG.save_every if r.kind == "damaged" else CONFIG.save_every + 1)
               for r in records), records
    assert all(r.fell_back for r in records if r.kind == "damaged" and r.step >= CONFIG.save_every), records
    assert live_processes_mentioning(str(tmp_path)) == []
