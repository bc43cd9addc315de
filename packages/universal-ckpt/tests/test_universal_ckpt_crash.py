"""R1 (SIGKILL during a save) and R2 (disk full): the last committed checkpoint always survives."""

from __future__ import annotations

import os
import random
import resource
import signal
import threading
import time

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import DistributedTestError, run_distributed
from plait.universal_ckpt import saver

PHASES = ("prepared", "data_written", "gathered", "manifest_written", "committed", "latest_moved", "pruned")

def _save_loop(root, first: int, last: int, kill_at: str) -> None:
    """Save steps ``first..last-1``; tensors hold their step, so any checkpoint can be checked."""
    if kill_at != "none":
        saver.set_fault_hook(lambda phase: os.kill(os.getpid(), signal.SIGKILL) if phase == kill_at else None)
    for step in range(first, last):
        state = {"a": torch.full((1 << 20,), float(step)), "b": torch.full((3, 5), float(step)),
                 "extra": {"step": step}}
        uc.save(state, root, step=step, keep_last=2, chunk_bytes=1 << 18)


def save_and_die(root: str, first: int, last: int, kill_at: str, delay: float | None) -> None:
    """A rank that saves step after step and is SIGKILLed at a phase or after ``delay`` seconds."""
    if delay is not None:
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    _save_loop(root, first, last, kill_at)
    time.sleep(60)  # a timer that had not fired yet still kills the process


def _killed(root, first: int, last: int, kill_at: str, delay: float | None = None) -> None:
    with pytest.raises(DistributedTestError, match="died with exit code -9"):
        run_distributed(save_and_die, 1, str(root), first, last, kill_at, delay, timeout=90)


def _check_latest(root) -> int:
    """The latest checkpoint verifies, loads, and holds its own step everywhere."""
    ckpt = uc.latest(root)
    assert ckpt is not None and not ckpt.name.startswith(".")
    uc.verify_checkpoint(ckpt)
    state = {"a": torch.zeros(1 << 20), "b": torch.zeros(3, 5), "extra": None}
    step = uc.load(state, root).step
    assert state["extra"] == {"step": step}
    assert torch.all(state["a"] == step) and torch.all(state["b"] == step)
    return step


def test_sigkill_at_every_phase(tmp_path):
    for phase in PHASES:
        root = tmp_path / phase
        _save_loop(root, 1, 3, "none")  # steps 1 and 2 committed normally
        _killed(root, 3, 4, phase)
        step = _check_latest(root)
        # Until the pointer moves, latest stays on step 2; a kill after the commit rename leaves
        # step 3 committed and complete (it verifies), just not yet pointed at.
        assert step == (3 if phase in ("latest_moved", "pruned") else 2), phase
        if phase == "committed":
            uc.verify_checkpoint(root / "step-0000000003")
        _save_loop(root, 4, 5, "none")  # the next save succeeds and cleans up
        assert _check_latest(root) == 4
        assert not [p for p in root.iterdir() if p.name.startswith((".tmp", ".trash"))]


def test_sigkill_at_random_moments(tmp_path):
    rng = random.Random(0)
    root = tmp_path / "random"
    _save_loop(root, 0, 1, "none")
    next_step = 1
    for _ in range(12):
        _killed(root, next_step, next_step + 50, "none", rng.uniform(0.0, 0.5))
        step = _check_latest(root)
        next_step = max(next_step + 1, step + 1) + 50  # never reuse a step a killed save may have committed


def die_in_save(root: str) -> None:
    uc.save({"t": torch.full((1000,), 1.0)}, root, step=1)
    if torch.distributed.get_rank() == 1:
        saver.set_fault_hook(lambda phase: os.kill(os.getpid(), signal.SIGKILL) if phase == "data_written" else None)
    uc.save({"t": torch.full((1000,), 2.0)}, root, step=2)


def test_rank_killed_mid_save_keeps_previous(tmp_path):
    with pytest.raises(DistributedTestError):
        run_distributed(die_in_save, 2, str(tmp_path), timeout=60)
    target = torch.zeros(1000)
    assert uc.load({"t": target}, tmp_path).step == 1 and torch.all(target == 1.0)


def disk_full(root: str) -> tuple[str, bool, int]:
    from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig, small_model

    engine = ToyZero(small_model(0), ToyZeroConfig(stage=3))
    uc.save({"zero": engine}, root, step=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    error = ""
    if torch.distributed.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death: what a full disk looks like
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    started = time.monotonic()
    try:
        uc.save({"zero": engine}, root, step=2)
    except uc.CheckpointWriteError as exc:
        error = str(exc)
    elapsed = time.monotonic() - started
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    uc.save({"zero": engine}, root, step=3)  # space is back: the next save succeeds
    return error, elapsed < 30, len(list(os.scandir(root)))


def test_disk_full_every_rank_raises(tmp_path):
    results = run_distributed(disk_full, 2, str(tmp_path), timeout=90)
    for error, quick, _ in results:
        assert "rank 1" in error and "nothing was committed" in error and quick
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000000001", "step-0000000003"]
    for ckpt in ("step-0000000001", "step-0000000003"):
        uc.verify_checkpoint(tmp_path / ckpt)
