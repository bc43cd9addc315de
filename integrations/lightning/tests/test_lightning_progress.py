"""The progress bar plait's Trainers use: it counts toward ``max_steps`` (not batches of a long
epoch), and off a terminal it writes plain lines, never carriage-return updates."""

from __future__ import annotations

import io

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from plait.lightning.progress import StepProgressBar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(bar: StepProgressBar, max_steps: int = 5, batches: int = 100) -> L.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(batches, 4), torch.randn(batches, 1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[bar], logger=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(_Tiny(), DataLoader(data, batch_size=1))
    return trainer


@pytest.mark.timeout(120)
def test_terminal_bar_counts_to_max_steps() -> None:
    stream = _Tty()
    bar = StepProgressBar(stream=stream)
    trainer = _fit(bar)
    assert trainer.global_step == 5
    assert bar.train_progress_bar.total == 5 and bar.train_progress_bar.n == 5
    text = stream.getvalue()
    assert "5/5" in text and "/100" not in text and "/-" not in text


@pytest.mark.timeout(120)
def test_no_carriage_returns_off_a_terminal() -> None:
    stream = io.StringIO()
    bar = StepProgressBar(stream=stream, plain_lines=5)
    _fit(bar, max_steps=10)
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0] == "training: step 0/10"
    assert any(line.startswith("training: step 10/10") for line in lines)
    assert 3 <= len(lines) <= 7  # a few plain lines, not one per step


def test_total_without_max_steps_is_lightnings() -> None:
    from types import SimpleNamespace

    from plait.lightning.progress import step_total

    assert step_total(SimpleNamespace(max_steps=-1)) is None
    assert step_total(SimpleNamespace(max_steps=None)) is None
    assert step_total(SimpleNamespace(max_steps=40)) == 40
