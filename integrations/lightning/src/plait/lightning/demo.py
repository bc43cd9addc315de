"""tiny-llama on the built-in corpus as a LightningModule: the main job's model, and the tests'.

The data position is the optimizer step: the micro-batch of step ``s`` is the global batch
``global_batch(s * accumulate + k, ...)`` (a pure function of the seed and the index) and every
rank takes its slice of it. Lightning saves and restores ``global_step`` in the checkpoint, so a
run resumed on any number of devices continues with exactly the batches the uninterrupted run
would have seen, and a 2-device run and a 1-device run see the same global batches.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from plait.kernels.testing import ByteTokenizer, global_batch, rank_slice, tiny_llama

# A small configuration for tests: seconds per run on 2 CPU cores.
TEST_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 96, "vocab_size": 300,
              "max_seq_len": 64}


class StepTicks(Dataset):
    """``length`` items whose values are ignored: the batch comes from the step (module docstring)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


class StepLoader(DataLoader):
    """A DataLoader whose position needs no saving (the step is the position), so Lightning treats
    a mid-epoch resume as exact."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the position is ``global_step``, restored by Lightning."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`state_dict`)."""


class TinyLlamaModule(pl.LightningModule):
    """tiny-llama trained on the built-in corpus.

    Args:
        model: overrides of :class:`plait.kernels.testing.TinyLlamaConfig` (default: the full model).
        batch_size: sequences in the global batch (divided across ranks).
        seq_len: tokens per sequence.
        lr: peak AdamW learning rate (linear warm-up over ``warmup`` steps, then cosine to 10%).
        warmup: warm-up steps.
        total_steps: steps of the cosine schedule.
        seed: data seed (and weight seed, set by the caller with ``L.seed_everything``).
        in_configure_model: build the network in ``configure_model`` (sharded, never whole on a rank)
            instead of ``__init__``.
    """

    def __init__(self, model: dict[str, Any] | None = None, *, batch_size: int = 8, seq_len: int = 64,
                 lr: float = 3e-3, warmup: int = 10, total_steps: int = 100, seed: int = 0,
                 in_configure_model: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_overrides = dict(model or {})
        self.model: torch.nn.Module | None = None if in_configure_model else tiny_llama(**self.model_overrides)

    def configure_model(self) -> None:
        """Build the network here when ``in_configure_model`` (the strategy's sharded context applies)."""
        if self.model is None:
            self.model = tiny_llama(**self.model_overrides)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        """The network's output (logits, and the loss when labels are given)."""
        return self.model(input_ids, labels=labels)

    def _local_batch(self, index: int) -> dict[str, torch.Tensor]:
        batch = global_batch(index, self.hparams.batch_size, self.hparams.seq_len, seed=self.hparams.seed)
        world = self.trainer.world_size if self._trainer is not None else 1
        local = rank_slice(batch, self.global_rank, world)
        return {k: v.to(self.device) for k, v in local.items()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Loss of this rank's slice of the step's global batch (logged averaged over ranks)."""
        accumulate = self.trainer.accumulate_grad_batches
        data = self._local_batch(self.global_step * accumulate + batch_idx % accumulate)
        loss = self(data["input_ids"], labels=data["labels"]).loss
        self.log("train_loss", loss, on_step=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Loss on fixed held-out windows (seed + 1 000 000)."""
        data = global_batch(batch_idx, self.hparams.batch_size, self.hparams.seq_len, seed=self.hparams.seed + 10**6)
        local = rank_slice(data, self.global_rank, self.trainer.world_size)
        loss = self(local["input_ids"].to(self.device), labels=local["labels"].to(self.device)).loss
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        """AdamW with warm-up and cosine decay, stepped every optimizer step."""
        # fused: torch's fastest AdamW on CPU and CUDA (and what the offload placements use anyway).
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, fused=True)
        warmup, total = self.hparams.warmup, self.hparams.total_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        """Step ticks (see the module docstring); enough for the longest run."""
        return StepLoader(StepTicks(10**6), batch_size=1)

    def val_dataloader(self) -> DataLoader:
        """Two held-out batches."""
        return DataLoader(StepTicks(2), batch_size=1)


class LossRecorder(pl.Callback):
    """Keeps the rank-averaged training loss of every optimizer step: ``losses[step] = value``."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Record after each optimizer step (the last micro-batch of an accumulation)."""
        value = trainer.callback_metrics.get("train_loss")
        if value is not None and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses[trainer.global_step - 1] = float(value)


@torch.no_grad()
def sample_text(model: torch.nn.Module, prompt: str, new_tokens: int, *, temperature: float = 0.8, top_k: int = 20,
                seed: int = 0) -> str:
    """Continue ``prompt`` with a (plain, unsharded) tiny-llama: top-k sampling with a fixed seed,
    so the sample is reproducible (greedy decoding of a briefly trained byte model only repeats
    its most frequent word).

    Args:
        model: the network.
        prompt: text to continue.
        new_tokens: bytes to generate.
        temperature: softmax temperature.
        top_k: sample among this many most likely bytes.
        seed: sampling seed.
    """
    tokenizer = ByteTokenizer()
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    limit = model.config.max_seq_len
    for _ in range(new_tokens):
        logits = model(ids[:, -limit:]).logits[0, -1, :256].float() / temperature
        values, indices = logits.topk(top_k)
        choice = torch.multinomial(values.softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, indices[choice].view(1, 1)], dim=1)
    return tokenizer.decode(ids[0])
