"""A ZeRO-3 training loop as a plain ``torchrun`` user writes it, with automatic resume and preemption.

``torchrun --standalone --nproc-per-node N [--max-restarts K] reliability_restart_job.py FAULT OUTDIR STEPS
SAVE_EVERY [VARIANT]`` (run by test_reliability_restart.py and test_reliability_exit_zero.py). VARIANT is
one of :data:`VARIANTS`, the setups behind plait-lightning's strategy names: ``1``, ``2``, ``3`` (the
ZeRO stage; 3 by default), ``2-cpu``, ``3-cpu``, ``3-nvme`` (offloaded through plait-offload-io, as
``plait_zero2_offload``/``plait_zero3_offload``/``plait_zero3_offload_nvme``) and ``3-zeropp``; or
one of the routes of ``reliability_routes.ROUTES`` (``1bit``, ``sp2``, ``ep2``):

* ``CheckpointManager.restore`` loads the newest committed universal checkpoint of OUTDIR/ckpt if
  there is one: a restarted worker (torchrun's ``--max-restarts``) or a relaunched job resumes by
  itself, with the data position (the step) and the RNG;
* a newest checkpoint that fails its hashes on load is moved aside (renamed ``damaged-...``, kept)
  and the one before it is loaded, down to a fresh start: nothing damaged is loaded;
* a checkpoint every SAVE_EVERY steps and one at the end;
* :class:`~plait.kernels.collectives.PreemptionGuard`: SIGTERM on any rank makes every rank save
  after the same step and exit 0;
* FAULT is ``none`` or comma-separated ``plait.kernels.testing.Fault`` texts, each acting on one
  torchrun attempt (``TORCHELASTIC_RESTART_COUNT``): ``kill:rank=1:step=4`` on the first,
  ``sigterm:rank=0:step=6@1`` on the first restart (a node failure does not repeat by itself);
  a ``damaged`` fault damages the newest checkpoint before it kills its rank.

Each rank appends ``attempt step loss.hex()`` lines to OUTDIR/losses-rank<r>.txt and JSON events
(start, resume, save, fault, preempted, done, with wall-clock times) to OUTDIR/events-rank<r>.jsonl.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from reliability_routes import ROUTES

import plait.universal_ckpt as uc
from plait.kernels import collectives
from plait.kernels.testing import Fault, global_batch, rank_slice
from plait.universal_ckpt.testing import small_model
from plait.zero_sharding import ZeroConfig, zero_shard

# VARIANT -> (ZeRO stage, offload device or None, ZeRO++ on): plait-lightning's NAMES, without Lightning.
VARIANTS: dict[str, tuple[int, str | None, bool]] = {
    "1": (1, None, False), "2": (2, None, False), "3": (3, None, False), "2-cpu": (2, "cpu", False),
    "3-cpu": (3, "cpu", False), "3-nvme": (3, "nvme", False), "3-zeropp": (3, None, True),
}
TIMEOUT_S = 30.0  # also how long init waits for every rank to join: imports are slow on a loaded machine
BATCH, SEQ = 12, 16


class Journal:
    """This rank's loss and event files (appended and flushed line by line: a kill loses nothing written)."""

    def __init__(self, outdir: Path, rank: int, attempt: int) -> None:
        self.losses, self.events = outdir / f"losses-rank{rank}.txt", outdir / f"events-rank{rank}.jsonl"
        self.attempt = attempt

    def loss(self, step: int, value: float) -> None:
        with self.losses.open("a") as handle:
            handle.write(f"{self.attempt} {step} {value.hex()}\n")

    def event(self, kind: str, step: int, **extra: object) -> None:
        row = {"attempt": self.attempt, "event": kind, "step": step, "time": time.time(), **extra}
        with self.events.open("a") as handle:
            handle.write(json.dumps(row) + "\n")


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One step on the batch of ``step`` (the data depends only on the step: a resume sees the same)."""
    batch = rank_slice(global_batch(step, BATCH, SEQ), dist.get_rank(), dist.get_world_size())
    loss = model(batch["input_ids"], batch["labels"]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def faults_of_attempt(text: str, attempt: int) -> list[Fault]:
    """The faults of FAULT (``none`` or ``fault[@attempt],...``) that act on ``attempt``."""
    found = []
    for item in text.split(",") if text != "none" else []:
        fault, _, when = item.partition("@")
        if int(when or 0) == attempt:
            found.append(Fault.parse(fault))
    return found


def shard(variant: str, outdir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The small model and AdamW under the ZeRO setup of ``variant`` (offload files under ``outdir``)."""
    stage, offload, zeropp = VARIANTS[variant]
    kwargs = {}
    if offload is not None:
        from plait.offload_io import OffloadConfig, zero_placement

        # As the Lightning offload names: stage 3 moves the parameter shards to the optimizer state's device.
        kwargs["placement"] = zero_placement(OffloadConfig(
            device=offload, param_device=offload if stage == 3 else "none",
            **({"path": outdir / f"nvme-rank{dist.get_rank()}"} if offload == "nvme" else {})))
    config = ZeroConfig(stage=stage, zeropp=True if zeropp else None)
    return zero_shard(small_model(0), torch.optim.AdamW, config, lr=1e-3, **kwargs)


def restore_newest_good(manager: uc.CheckpointManager, state: dict, journal: Journal) -> int:
    """Load the newest checkpoint that passes its checks; returns its step (0: none, a fresh start).

    A checkpoint refused on load (hashes, format) is renamed ``damaged-<name>-<n>`` by rank 0
    (kept for a person to look at, no longer committed) and the next older one is tried. A refused
    load leaves ``state`` untouched, so trying the next one is safe.
    """
    while (newest := manager.latest()) is not None:
        try:
            return manager.restore(state) or 0
        except uc.CheckpointError as exc:  # integrity or format here, "refused on other ranks" there
            if isinstance(exc, uc.CheckpointNotFoundError):
                raise
            journal.event("fallback", 0, damaged=newest.name, error=str(exc)[:300])
            if dist.get_rank() == 0:  # a fresh name: a requeued job restarts its attempt count
                aside = next(newest.with_name(f"damaged-{newest.name}-{i}") for i in range(1, 1 << 20)
                             if not newest.with_name(f"damaged-{newest.name}-{i}").exists())
                newest.rename(aside)
            dist.barrier()
    return 0


def build(variant: str, outdir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """The model, optimizer and one-step function (step -> loss) of a ZeRO variant or a route."""
    if variant in ROUTES:
        return ROUTES[variant]()
    model, optimizer = shard(variant, outdir)
    return model, optimizer, partial(train_step, model, optimizer)


def main(fault_text: str, outdir: Path, steps: int, save_every: int, variant: str = "3") -> int:
    """Train, resuming from and saving to ``outdir/ckpt``; returns the exit code."""
    # Python stacks of every thread on SIGABRT/SIGSEGV: the one teardown abort left unexplained (docs/reliability.md,
    # "A finished run exits 0") then shows which threads were alive and where the main thread was.
    faulthandler.enable(all_threads=True)
    attempt = collectives.restart_count()
    faults = faults_of_attempt(fault_text, attempt)
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))  # restart-safe
    rank = dist.get_rank()
    journal = Journal(outdir, rank, attempt)
    (outdir / f"pid{rank}-attempt{attempt}").write_text(str(os.getpid()))
    journal.event("start", 0)
    model, optimizer, one_step = build(variant, outdir)
    state = {"model": model, "rng": uc.RNGState()}
    manager = uc.CheckpointManager(uc.CheckpointConfig(root=outdir / "ckpt", keep_last=2))
    start = restore_newest_good(manager, state, journal)
    if start:
        journal.event("resume", start)
    guard = collectives.PreemptionGuard(grace_s=TIMEOUT_S).install()
    for step in range(start, steps):
        collectives.set_step(step)
        for fault in faults:
            if fault.fires(step, rank):
                journal.event("fault", step, fault=str(fault))
                fault.maybe_inject(step, rank, checkpoint=manager.latest() if fault.kind == "damaged" else None)
        journal.loss(step, one_step(step))
        done = step + 1
        if guard.should_stop():
            began = time.time()
            manager.save(state, step=done)
            journal.event("preempted", done, signalled_at=guard.signalled_at, stopped_at=guard.stopped_at,
                          save_s=time.time() - began)
            break
        if done % save_every == 0 or done == steps:
            began = time.time()
            manager.save(state, step=done)
            journal.event("save", done, save_s=time.time() - began)  # one whole save: what an async one costs
    else:
        journal.event("done", steps)
    guard.uninstall()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6]))
