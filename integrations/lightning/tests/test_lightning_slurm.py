"""SlurmRequeue's pieces in one process: the job id it requeues and when it takes the signals over.

The whole path (faked srun variables and scontrol, SIGUSR1 to every task, the hpc checkpoint, the
requeued job resuming bit for bit) is tests/test_reliability_slurm_requeue.py.
"""

from __future__ import annotations

import signal
import types

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from plait.lightning.slurm import SlurmRequeue, requeue_job_id


def _trainer(environment: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(_accelerator_connector=types.SimpleNamespace(cluster_environment=environment))


def test_the_job_id_is_slurms_own(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="SLURM_JOB_ID"):
        requeue_job_id()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert requeue_job_id() == "4242"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "17")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue_job_id() == "17_3"  # an array task is requeued as ARRAYJOB_TASK, as Lightning does
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "17; rm -rf /")
    with pytest.raises(RuntimeError, match="not a SLURM job id"):
        requeue_job_id()


def test_signals_are_taken_over_only_under_slurm_auto_requeue(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    before = signal.getsignal(signal.SIGUSR1)
    assert SlurmRequeue.install(_trainer(LightningEnvironment())) is None
    assert SlurmRequeue.install(_trainer(SLURMEnvironment(auto_requeue=False))) is None
    assert signal.getsignal(signal.SIGUSR1) is before
    handler = SlurmRequeue.install(_trainer(SLURMEnvironment()))
    try:
        assert handler is not None and signal.getsignal(signal.SIGUSR1) == handler._on_signal
        assert signal.getsignal(signal.SIGTERM) != handler._on_sigterm  # not Lightning's handler: left alone
        signal.raise_signal(signal.SIGUSR1)
        assert handler.signalled_at is not None and handler.saved_path is None  # recorded only: no save here
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_lightnings_sigterm_handler_becomes_one_that_runs_no_collective(monkeypatch):
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    lightnings = _HandlersCompose([lambda signum, frame: pytest.fail("Lightning's handler ran")])
    previous = signal.signal(signal.SIGTERM, lightnings)
    trainer = _trainer(SLURMEnvironment())
    trainer._signal_connector = types.SimpleNamespace(received_sigterm=False)
    handler = SlurmRequeue.install(trainer)
    try:
        assert signal.getsignal(signal.SIGTERM) == handler._on_sigterm
        signal.raise_signal(signal.SIGTERM)
        assert trainer._signal_connector.received_sigterm  # Lightning's loop stops every rank on it
        handler.uninstall()
        assert signal.getsignal(signal.SIGTERM) is lightnings
    finally:
        signal.signal(signal.SIGTERM, previous)
