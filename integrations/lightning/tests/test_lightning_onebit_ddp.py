"""The entry-point callback that lets Lightning's ``strategy="ddp"`` take a plait 1-bit optimizer
(:mod:`plait.lightning.onebit_ddp`), without plait-onebit-optim: what it refuses, when it does
nothing, and that Lightning finds it. The run itself (bitwise the optimizer without DDP) needs
both distributions: ``tests/test_onebit_lightning.py``."""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from plait.lightning.onebit_ddp import OptimizerOwnsExchange, callbacks, check_ddp_settings, local_gradients_hook


def _trainer(**overrides: object) -> SimpleNamespace:
    settings = {"strategy": SimpleNamespace(_ddp_comm_hook=None, model=torch.nn.Linear(2, 2)),
                "gradient_clip_val": None, "precision_plugin": SimpleNamespace(scaler=None, precision="32-true"),
                "optimizers": []}
    settings.update(overrides)
    return SimpleNamespace(**settings)


def test_lightning_loads_the_callback_from_the_entry_point():
    (entry,) = [e for e in entry_points(group="lightning.pytorch.callbacks_factory") if e.name == "plait_onebit_ddp"]
    assert entry.value == "plait.lightning.onebit_ddp:callbacks"
    assert [type(c) for c in callbacks()] == [OptimizerOwnsExchange]


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
