"""The opt-in callback that lets Lightning's ``strategy="ddp"`` take a plait 1-bit optimizer
(:mod:`plait.lightning.onebit_ddp`), without plait-onebit-optim: what it refuses, when it does
nothing, and that installing plait-lightning adds no callback to Lightning's Trainers. The run itself
(bitwise the optimizer without DDP) needs
both distributions: ``tests/test_onebit_lightning.py``."""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from plait.kernels.testing import run_distributed
from plait.lightning.onebit_ddp import (
    CHECKPOINT_KEY,
    OptimizerOwnsExchange,
    check_ddp_settings,
    check_replicated,
    local_gradients_hook,
)


def _trainer(**overrides: object) -> SimpleNamespace:
    settings = {"strategy": SimpleNamespace(_ddp_comm_hook=None, model=torch.nn.Linear(2, 2)),
                "gradient_clip_val": None, "precision_plugin": SimpleNamespace(scaler=None, precision="32-true"),
                "optimizers": []}
    settings.update(overrides)
    return SimpleNamespace(**settings)


def test_no_callback_is_added_to_every_trainer():
    """The callback is the script's choice: plait-lightning registers no Lightning callback factory."""
    assert not [e for e in entry_points(group="lightning.pytorch.callbacks_factory") if e.value.startswith("plait.")]


def test_accepts_plain_settings():
    check_ddp_settings(_trainer(), "OnebitAdam", others=0)


@pytest.mark.parametrize("overrides, others, needle", [
    ({}, 1, "1 other optimizer(s)"),
    ({"strategy": SimpleNamespace(_ddp_comm_hook=print)}, 0, "ddp_comm_hook"),
    ({"gradient_clip_val": 0.5}, 0, "gradient_clip_val=0.5"),
    ({"precision_plugin": SimpleNamespace(scaler=object(), precision="16-mixed")}, 0, "precision='16-mixed'"),
])
def test_refusals_name_the_setting_and_the_fix(overrides, others, needle):
    with pytest.raises(ValueError) as caught:
        check_ddp_settings(_trainer(**overrides), "OnebitAdam", others=others)
    message = str(caught.value)
    assert needle in message and "OnebitAdam" in message
    assert "plait_zero1" in message or "drop" in message


def test_does_nothing_without_ddp_or_without_a_onebit_optimizer():
    class OwnsExchange(torch.optim.SGD):
        owns_gradient_exchange = True

    model = torch.nn.Linear(2, 2)
    callback = OptimizerOwnsExchange()
    # A 1-bit-style optimizer on an unwrapped model (plait strategies, one device): nothing to turn off.
    callback.on_fit_start(_trainer(optimizers=[OwnsExchange(model.parameters(), lr=0.1)]), None)
    # An ordinary optimizer: DDP keeps its all-reduce (not even the settings are checked).
    callback.on_fit_start(_trainer(optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], gradient_clip_val=1.0),
                          None)
    assert callback.hooked == ()


def test_the_hook_returns_the_bucket_unchanged():
    buffer = torch.arange(5.0)
    future = local_gradients_hook(None, SimpleNamespace(buffer=lambda: buffer))
    assert future.done() and future.value() is buffer


def _checkpoint(world: int, exchanges: list) -> dict:
    parts = [[{"kind": "OnebitAdam", "rank": r, "exchanges": exchanges}] for r in range(world)]
    return {"optimizer_states": [{"state": {}, "onebit": parts[0][0]}],
            CHECKPOINT_KEY: {"world": world, "indices": [0], "ranks": parts}}


def test_load_hands_each_rank_its_own_part_and_refuses_another_world():
    callback = OptimizerOwnsExchange()
    same = _checkpoint(1, [{"worker_error": torch.ones(8)}])
    callback.on_load_checkpoint(None, None, same)  # one process: rank 0 of 1
    assert same["optimizer_states"][0]["onebit"] is same[CHECKPOINT_KEY]["ranks"][0][0]
    with pytest.raises(ValueError, match="error feedback of 4 ranks and the run has 1"):
        callback.on_load_checkpoint(None, None, _checkpoint(4, [{"worker_error": torch.ones(8)}]))
    warmup = _checkpoint(4, [None])  # no exchange yet: every rank's state is rank 0's, any world
    callback.on_load_checkpoint(None, None, warmup)
    assert warmup["optimizer_states"][0]["onebit"]["rank"] == 0


def _replicas(differ: bool) -> str:
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, 1.0)
    if differ:
        model.bias.data.fill_(float(torch.distributed.get_rank()))  # a rank's own local steps
    try:
        check_replicated(model, ("ZeroOneAdam",))
    except RuntimeError as exc:
        return str(exc)
    return "saved"


@pytest.mark.timeout(120)
def test_a_save_while_the_ranks_parameters_differ_is_refused():
    assert run_distributed(_replicas, 2, False, timeout=100) == ["saved", "saved"]
    for message in run_distributed(_replicas, 2, True, timeout=100):
        assert "ranks' parameters differ" in message and "synchronisation" in message
