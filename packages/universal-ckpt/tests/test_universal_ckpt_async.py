"""R7: async saves snapshot before returning, one in flight, failures surface on the next wait/save."""

from __future__ import annotations

import time

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt import saver
from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig, small_model, train_steps


def _fresh_master(root, step: int) -> torch.Tensor:
    engine = ToyZero(small_model(42), ToyZeroConfig(stage=3))
    uc.load({"zero": engine}, f"{root}/step-{step:010d}")
    return engine.master.clone()


def async_scenarios(root: str) -> dict:
    rank = torch.distributed.get_rank()
    model = small_model(0)
    engine = ToyZero(model, ToyZeroConfig(stage=3))
    train_steps(model, engine, range(1))
    before = engine.master.clone()
    handle = uc.save({"zero": engine}, root, step=1, async_=True)
    engine.master.add_(1.0)  # changes right after the save returned must not reach the checkpoint
    engine.exp_avg.add_(1.0)
    train_steps(model, engine, range(1, 2))  # training (and its collectives) overlaps the write
    assert handle.wait(timeout=60).name == "step-0000000001"
    snapshot_ok = torch.equal(_fresh_master(root, 1), before)

    saver.set_fault_hook(lambda phase: time.sleep(1.0) if phase == "data_written" else None)
    slow = uc.save({"zero": engine}, root, step=2, async_=True)
    with pytest.raises(uc.SaveInFlightError):
        uc.save({"zero": engine}, root, step=3, if_busy="raise")
    uc.save({"zero": engine}, root, step=3, if_busy="wait")  # waits for step 2 first
    waited = slow.done() and (uc.latest(root).name == "step-0000000003")

    def fail_on_rank1(phase: str) -> None:
        if phase == "data_written" and rank == 1:
            raise OSError(28, "No space left on device (injected)")

    saver.set_fault_hook(fail_on_rank1)
    failing = uc.save({"zero": engine}, root, step=4, async_=True)
    while not failing.done():
        time.sleep(0.01)
    saver.set_fault_hook(None)
    surfaced = ""
    try:
        uc.save({"zero": engine}, root, step=5)
    except uc.CheckpointWriteError as exc:
        surfaced = str(exc)
    uc.save({"zero": engine}, root, step=5)
    failing.wait()  # the failure was reported once, by the save above; it is not raised twice
    return {"snapshot_ok": snapshot_ok, "waited": waited, "surfaced": surfaced,
            "latest": uc.latest(root).name}


def test_async_save_semantics(tmp_path):
    for result in run_distributed(async_scenarios, 2, str(tmp_path), timeout=120):
        assert result["snapshot_ok"], "the async checkpoint holds values changed after save() returned"
        assert result["waited"]
        assert "rank 1" in result["surfaced"] and "No space left" in result["surfaced"]
        assert result["latest"] == "step-0000000005"
    assert not (tmp_path / "step-0000000004").exists()


def test_async_failure_surfaces_on_wait(tmp_path):
    saver.set_fault_hook(lambda phase: (_ for _ in ()).throw(OSError(5, "EIO")) if phase == "data_written" else None)
    try:
        handle = uc.save({"t": torch.ones(4)}, tmp_path, step=1, async_=True)
        with pytest.raises(uc.CheckpointWriteError, match="EIO"):
            handle.wait(timeout=30)
    finally:
        saver.set_fault_hook(None)
    uc.wait_pending()  # already reported: nothing raised again
    uc.save({"t": torch.ones(4)}, tmp_path, step=1)
    assert uc.latest(tmp_path).name == "step-0000000001"
