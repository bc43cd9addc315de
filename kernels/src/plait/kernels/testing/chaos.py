"""A chaos campaign: a training job under random faults, restarted as a scheduler would, must end
with the weights of the run that saw none.

The faults are :class:`~plait.kernels.testing.faults.Fault` kinds, drawn (seeded) per job and placed
at random steps, each after the point the job will have resumed from after the previous one:

* ``kill`` (a rank SIGKILLed), ``hang`` (a rank stops past the job's collective timeout) and
  ``diskfull`` (a rank's files cannot grow, so its next checkpoint save fails): the launch's
  workers die, and torchrun's ``--max-restarts`` starts them again from the newest checkpoint;
* ``sigterm`` (a scheduler's preemption): every rank saves after the same step and the launch
  exits 0 unfinished; the driver launches the job again (SLURM-style requeue);
* ``damaged`` (the newest checkpoint has a bit flipped, then its rank is killed): torchrun restarts
  the workers, and the job must find the damage (the checkpoint's hashes) and resume from the one
  before it, losing at most one save interval more than a kill; nothing damaged may be loaded;
* ``slow`` (a straggler for the rest of the attempt): nothing restarts, nothing may be lost.

The driver knows a job only through a :class:`ChaosJob`: launch it, read its final weights, read
its events (``start``, ``resume``, ``save``, ``preempted``, ``fault``, ``fallback`` (a damaged
checkpoint refused on load and set aside), ``done``, each with ``attempt``, ``step`` and wall-clock
``time``), as ``tests/reliability_restart_job.py`` writes them.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from plait.kernels.testing.faults import Fault

__all__ = ["RESTARTING", "ChaosConfig", "ChaosJob", "FaultRecord", "plan_faults", "resume_point", "run_campaign",
           "summarize"]

RESTARTING = ("kill", "hang", "diskfull", "damaged")  # the launch's workers die; torchrun restarts them
KINDS = (*RESTARTING, "sigterm", "slow")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """A campaign's settings.

    Attributes:
        seed: seeds every draw (setup, kind, rank, step).
        faults: faults in all (spread over jobs of ``faults_per_job``).
        faults_per_job: faults injected into one job before it may finish.
        kinds: the fault kinds drawn from (a subset of ``kill``, ``hang``, ``diskfull``,
            ``damaged``, ``sigterm``, ``slow``).
        steps: training steps of each job.
        save_every: the job's checkpoint interval (restarts resume from a multiple of it).
        world_size: ranks of each job.
        hang_s: how long a ``hang`` rank sleeps (longer than the job's collective timeout).
        slow_s: how late a ``slow`` rank is at each step.
        disk_bytes: the largest file a ``diskfull`` rank can still write (above the job's log
            files, below one checkpoint file).
        keep_last: the checkpoints the job keeps (a ``damaged`` fault falls back to the one before
            the newest, so at least 2 where ``damaged`` is drawn).
        max_launches: launches of one job before it counts as not recovered.
        jobs_at_once: jobs run side by side (each its own torchrun; much of a restart is waiting
            for timeouts and rendezvous, so a long campaign runs several). The draws are the same
            for any value; the seconds lost grow with the load it adds.
    """

    seed: int = 0
    faults: int = 20
    faults_per_job: int = 3
    kinds: tuple[str, ...] = ("kill", "diskfull", "sigterm", "slow")
    steps: int = 9
    save_every: int = 3
    world_size: int = 2
    hang_s: float = 3600.0
    slow_s: float = 0.05
    disk_bytes: int = 16384
    keep_last: int = 2
    max_launches: int = 6
    jobs_at_once: int = 1

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise ValueError(f"ChaosConfig.kinds={self.kinds!r}: use a non-empty subset of {KINDS}.")
        for name in ("faults", "faults_per_job", "save_every", "world_size", "keep_last", "max_launches",
                     "jobs_at_once"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChaosConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.steps <= self.save_every:
            raise ValueError(f"ChaosConfig.steps={self.steps} must exceed save_every={self.save_every} "
                             "(a restart must have a checkpoint to resume from).")
        if "damaged" in self.kinds and self.keep_last < 2:
            raise ValueError(f"ChaosConfig.keep_last={self.keep_last} must be >= 2 when 'damaged' is drawn "
                             "(the restart falls back to the checkpoint before the damaged one).")


class ChaosJob(Protocol):
    """How the driver runs one training setup."""

    def launch(self, outdir: Path, faults: str, max_restarts: int) -> int:
        """Run the job once (torchrun, ``max_restarts``); ``faults`` as ``fault@attempt,...``; exit code."""

    def weights(self, outdir: Path) -> dict[str, Any]:
        """The final checkpoint's tensors."""

    def events(self, outdir: Path) -> list[dict[str, Any]]:
        """Every rank's events, in time order."""


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """What one injected fault cost.

    Attributes:
        setup: the training setup it hit.
        kind, rank, step: the fault.
        recovered: the job finished and its final weights are bitwise the uninterrupted run's.
        steps_lost: steps trained again because of it (for ``diskfull``, up to the save that failed;
            for ``damaged``, back to the checkpoint before the damaged one).
        seconds_lost: wall-clock from the last commit before the fault to the resumed run's start
            (redone work plus restart); for ``slow``, the delay injected.
    """

    setup: str
    kind: str
    rank: int
    step: int
    recovered: bool
    steps_lost: int
    seconds_lost: float
    fell_back: bool = False  # a ``damaged`` fault: the restart refused the damaged checkpoint


def resume_point(fault: Fault, position: int, saved: Sequence[int], config: ChaosConfig) -> tuple[int, list[int]]:
    """Where a job resumes after ``fault``, following its checkpoints.

    Args:
        fault: the fault, at or after ``position``.
        position: the step the current attempt started from.
        saved: the steps of the committed checkpoints when the attempt started, oldest first.
        config: the campaign's settings (``save_every``, ``keep_last``).

    Returns:
        The step the next attempt starts from (after ``sigterm`` or ``slow``, the step after the
        fault; after a restarting fault the newest checkpoint's, and for ``damaged`` the one before
        it: the damaged one is refused and set aside), and the committed checkpoints then.
    """
    # Saves of this attempt so far: after each step whose count is a multiple of save_every (one at
    # ``position`` itself is the checkpoint it resumed from, or the save after a slow fault's step).
    first = -(-max(position, 1) // config.save_every) * config.save_every
    kept = [*saved, *range(first, fault.step + 1, config.save_every)]
    if fault.kind == "sigterm":
        kept.append(fault.step + 1)  # every rank saves after the fault's step
    kept = sorted(set(kept))[-config.keep_last:]
    if fault.kind in ("sigterm", "slow"):
        return fault.step + 1, kept
    if fault.kind == "damaged" and kept:
        kept.pop()
    return (kept[-1] if kept else 0), kept


def plan_faults(config: ChaosConfig, rng: random.Random) -> list[list[Fault]]:
    """One job's faults, grouped by launch (in each, the i-th restarting fault acts on attempt i).

    Each fault's step is drawn at or after the step the job resumes from after the previous one
    (:func:`resume_point`), so every drawn fault fires.
    """
    launches: list[list[Fault]] = [[]]
    position, saved = 0, []
    for _ in range(config.faults_per_job):
        if position >= config.steps:
            break
        kind = rng.choice(config.kinds)
        step = rng.randrange(position, config.steps)
        extra = {"hang": {"seconds": config.hang_s}, "slow": {"seconds": config.slow_s},
                 "diskfull": {"nbytes": config.disk_bytes}}.get(kind, {})
        launches[-1].append(Fault(kind=kind, rank=rng.randrange(config.world_size), step=step, **extra))
        position, saved = resume_point(launches[-1][-1], position, saved, config)
        if kind == "sigterm":
            launches.append([])  # every rank saves after this step; the next launch resumes there
    return [faults for faults in launches if faults] or [[]]


def _fault_text(faults: Sequence[Fault]) -> tuple[str, int]:
    """The job's FAULT argument (restarting faults on successive attempts) and ``--max-restarts``."""
    items, attempt = [], 0
    for fault in faults:
        items.append(f"{fault}@{attempt}")
        attempt += fault.kind in RESTARTING
    return ",".join(items) or "none", attempt


def run_job(job: ChaosJob, outdir: Path, config: ChaosConfig, launches: list[list[Fault]]) -> tuple[bool, int]:
    """Launch until the job is done (requeueing after each exit); returns (finished, launches used)."""
    outdir.mkdir(parents=True, exist_ok=True)
    used = 0
    for planned in [*launches, *[[]] * config.max_launches]:
        if used >= config.max_launches:
            break
        text, restarts = _fault_text(planned)
        used += 1
        rc = job.launch(outdir, text, restarts)
        if rc == 0 and any(e["event"] == "done" for e in job.events(outdir)):
            return True, used
    return False, used


def _fired(events: list[dict[str, Any]], fault: Fault, nth: int) -> dict[str, Any] | None:
    """The event of the ``nth`` time ``fault`` fired (a job may draw the same fault again after it
    resumed before it), or None."""
    fired = [e for e in events if e["event"] == "fault" and e.get("fault") == str(fault) and e["step"] == fault.step]
    return fired[nth] if nth < len(fired) else None


def _next_attempt(events: list[dict[str, Any]], at: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of the attempt that started after the event ``at`` (empty if none did)."""
    later = [e for e in events if e["time"] > at["time"]]
    start = next((e for e in later if e["event"] == "start"), None)
    if start is None:
        return []
    window = []
    for event in later[later.index(start):]:
        if event["attempt"] != start["attempt"]:
            break
        window.append(event)
    return window


def _costs(events: list[dict[str, Any]], fault: Fault, config: ChaosConfig, nth: int = 0) -> tuple[int, float]:
    """Steps and seconds the ``nth`` drawing of one fault cost, from the job's events (see :class:`FaultRecord`)."""
    at = _fired(events, fault, nth)
    if at is None:
        return 0, 0.0
    if fault.kind == "slow":
        later = [e for e in events if e["time"] > at["time"] and e["event"] in ("save", "preempted", "done")]
        steps = (later[-1]["step"] if later else fault.step) - fault.step
        return 0, steps * fault.seconds
    after = [e for e in _next_attempt(events, at) if e["event"] in ("start", "resume")]
    resumed = next((e for e in after if e["event"] == "resume"), None)  # none: a fresh start
    resume_step = resumed["step"] if resumed else 0
    commits = [e for e in events if e["time"] <= at["time"] and e["event"] in ("save", "preempted")
               and e["step"] == resume_step]
    since = commits[-1]["time"] if commits else min(e["time"] for e in events)
    restarted = resumed or (after[0] if after else at)
    # Trained and lost: up to the fault's step, or for a full disk up to the save that failed.
    reached = fault.step
    if fault.kind == "diskfull":  # a damaged checkpoint's redone steps come out of resume_step
        reached = min(-(-(fault.step + 1) // config.save_every) * config.save_every, config.steps)
    return max(reached - resume_step, 0), max(restarted["time"] - since, 0.0)


def _fell_back(events: list[dict[str, Any]], fault: Fault, nth: int = 0) -> bool:
    """Whether a ``damaged`` fault's restart refused the damaged checkpoint (a ``fallback`` event after it)."""
    at = _fired(events, fault, nth)
    return fault.kind == "damaged" and at is not None and any(
        e["event"] == "fallback" for e in _next_attempt(events, at))


def _plan_campaign(config: ChaosConfig, names: list[str]) -> list[tuple[str, list[list[Fault]]]]:
    """Every job of the campaign: its setup and its faults by launch (all drawn before any runs)."""
    rng = random.Random(config.seed)
    offset = rng.randrange(len(names))
    jobs: list[tuple[str, list[list[Fault]]]] = []
    drawn = 0
    while drawn < config.faults:
        name = names[(offset + len(jobs)) % len(names)]
        kept = []
        for planned in plan_faults(config, rng):  # the last job keeps only the faults still wanted
            kept.append(planned[:config.faults - drawn])
            drawn += len(kept[-1])
        jobs.append((name, kept))
    return jobs


def run_campaign(config: ChaosConfig, setups: dict[str, ChaosJob], workdir: Path,
                 reference: Callable[[str], dict[str, Any]],
                 same: Callable[[dict[str, Any], dict[str, Any]], bool]) -> list[FaultRecord]:
    """Run jobs under drawn faults until ``config.faults`` have been injected.

    The draws do not depend on how many jobs run at once (``config.jobs_at_once``): every job is
    planned first. The uninterrupted runs come first (one per setup drawn), then the faulted jobs.

    Args:
        config: the campaign's settings.
        setups: name -> job; each job draws its setup from these (round robin from a seeded start).
        workdir: a fresh directory per job is made under it.
        reference: setup name -> the uninterrupted run's final weights.
        same: whether two weight dicts are bitwise equal.

    Returns:
        One record per injected fault, in order.
    """
    jobs = _plan_campaign(config, sorted(setups))
    used = sorted({name for name, _ in jobs})

    def one(index: int) -> list[FaultRecord]:
        name, launches = jobs[index]
        outdir = workdir / f"job{index:03d}-{name}"
        finished, _ = run_job(setups[name], outdir, config, launches)
        equal = finished and same(setups[name].weights(outdir), wanted[name])
        events = setups[name].events(outdir)
        records = []
        drawn = [f for planned in launches for f in planned]
        for index, fault in enumerate(drawn):
            nth = drawn[:index].count(fault)  # the same fault drawn again fires again, later
            steps, seconds = _costs(events, fault, config, nth)
            records.append(FaultRecord(name, fault.kind, fault.rank, fault.step, equal, steps, seconds,
                                       _fell_back(events, fault, nth)))
        return records

    with ThreadPoolExecutor(config.jobs_at_once) as pool:  # each job is its own torchrun session
        wanted = dict(zip(used, pool.map(reference, used)))
        return [record for records in pool.map(one, range(len(jobs))) for record in records]


def summarize(records: Sequence[FaultRecord]) -> dict[str, Any]:
    """The campaign's figures: faults injected and recovered, work lost per fault (median, worst)."""
    steps = [r.steps_lost for r in records] or [0]
    seconds = [r.seconds_lost for r in records] or [0.0]
    return {"faults": len(records), "recovered": sum(r.recovered for r in records),
            "kinds": {k: sum(r.kind == k for r in records) for k in sorted({r.kind for r in records})},
            "setups": sorted({r.setup for r in records}),
            "damaged_refused": sum(r.fell_back for r in records),
            "steps_lost_median": statistics.median(steps), "steps_lost_worst": max(steps),
            "seconds_lost_median": round(statistics.median(seconds), 2), "seconds_lost_worst": round(max(seconds), 2)}
