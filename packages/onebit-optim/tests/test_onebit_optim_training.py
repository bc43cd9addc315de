"""Training on models nobody wrote for this package: a tiny HF Llama and a torch.nn Transformer.

Convergence at W=2 against DDP + AdamW, and save/restore mid-run (after warm-up) continuing
bit for bit, error feedback included.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.onebit_optim import (
    Lamb,
    OnebitAdam,
    OnebitAdamConfig,
    OnebitLamb,
    OnebitLambConfig,
    ZeroOneAdam,
    ZeroOneAdamConfig,
)

VOCAB, SEQ, BATCH = 259, 32, 8
STEPS = 300
# On this tiny model Adam's variance is still moving at 15% of 300 steps, and a variance frozen
# that early costs ~7% of final loss even with exact communication (measured at W=1, README);
# DeepSpeed's guidance is 15-25% of long runs. Half the run keeps 1-bit Adam within 2%.
WARM_FRACTION = 0.5


def hf_llama() -> torch.nn.Module:
    """A tiny random transformers LlamaForCausalLM, built offline from a config."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


class TorchLM(torch.nn.Module):
    """A causal LM from stock torch.nn parts: Embedding, TransformerEncoder, Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 2, 128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        logits = self.head(self.encoder(self.embed(input_ids), mask=mask, is_causal=True))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_model(name: str) -> torch.nn.Module:
    return hf_llama() if name == "hf_llama" else TorchLM()


def make_optimizer(kind: str, params, steps: int, lr: float):
    warm = max(1, int(WARM_FRACTION * steps))
    if kind == "onebit_adam":
        return OnebitAdam(params, lr=lr, weight_decay=0.01, config=OnebitAdamConfig(freeze_step=warm))
    if kind == "onebit_lamb":
        return OnebitLamb(params, lr=lr, weight_decay=0.01, config=OnebitLambConfig(freeze_step=warm))
    if kind == "zero_one_adam":
        return ZeroOneAdam(params, lr=lr, weight_decay=0.01, config=ZeroOneAdamConfig(
            var_freeze_step=warm, var_update_scaler=16, local_step_scaler=max(1, steps // 8), local_step_clipper=4))
    if kind == "ddp_lamb":
        return Lamb(params, lr=lr, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def step_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = rank_slice(global_batch(step, BATCH, SEQ), rank, world)
    out = model(input_ids=data["input_ids"], labels=data["labels"])
    return out if isinstance(out, torch.Tensor) else out.loss


def train(model, optimizer, start: int, steps: int) -> list[float]:
    """Per-step global mean loss (all-reduced with torch directly: reporting, not training)."""
    losses = []
    for step in range(start, start + steps):
        loss = step_loss(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report = loss.detach().clone()
        dist.all_reduce(report)
        losses.append(report.item() / dist.get_world_size())
    return losses


def _run(model_name: str, kind: str, steps: int, lr: float) -> list[float]:
    model = make_model(model_name)
    if kind.startswith("ddp"):
        model = DistributedDataParallel(model)
    return train(model, make_optimizer(kind, model.parameters(), steps, lr), 0, steps)


def tail(losses: list[float]) -> float:
    """Mean of the last 20 losses (one step's loss is too noisy a figure)."""
    return sum(losses[-20:]) / 20


def final(world: int, kind: str, lr: float) -> float:
    return tail(run_distributed(_run, world, "hf_llama", kind, STEPS, lr, timeout=300)[0])


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "reference", "lr"), [("onebit_adam", "ddp_adamw", 1e-3),
                                                       ("onebit_lamb", "ddp_lamb", 1e-2)])
def test_hf_llama_within_2_percent_of_ddp(kind, reference, lr):
    ours, theirs = final(2, kind, lr), final(2, reference, lr)
    assert ours <= theirs * 1.02, (kind, ours, reference, theirs)


@pytest.mark.slow
def test_zero_one_adam_loses_nothing_to_compression():
    # 0/1 Adam (no bias correction, rare variance updates) ends ~12% above AdamW on this 300-step
    # run with or without compression (README); what the 1-bit exchange and local steps must not
    # do is add to that: W=2 (compressed) against W=1 (the same global batch, exact).
    compressed, exact = final(2, "zero_one_adam", 1e-3), final(1, "zero_one_adam", 1e-3)
    assert compressed <= exact * 1.02, (compressed, exact)


def _save_resume(kind: str, save_at: int, more: int) -> dict:
    """Train to ``save_at`` (past warm-up), save, go on ``more`` steps; then resume a fresh copy."""
    model = make_model("torch_lm")
    optimizer = make_optimizer(kind, model.parameters(), save_at, 3e-3)
    train(model, optimizer, 0, save_at)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, blob)
    uninterrupted = train(model, optimizer, save_at, more)

    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    resumed_model = make_model("torch_lm")
    resumed_model.load_state_dict(saved["model"])
    resumed_opt = make_optimizer(kind, resumed_model.parameters(), save_at, 3e-3)
    resumed_opt.load_state_dict(saved["optim"])
    resumed = train(resumed_model, resumed_opt, save_at, more)
    errors = saved["optim"]["onebit"]["exchanges"][0]
    return {"uninterrupted": uninterrupted, "resumed": resumed,
            "error_saved": errors is not None and bool(errors["worker_error"].abs().sum() > 0)}


@pytest.mark.parametrize(("world", "kind"), [(2, "onebit_adam"), (2, "onebit_lamb"), (2, "zero_one_adam"),
                                           (4, "onebit_adam")])
def test_resume_after_warmup_continues_bit_for_bit(world, kind):
    for out in run_distributed(_save_resume, world, kind, 8, 6, timeout=120):
        assert out["error_saved"]  # the state really carried non-zero error feedback
        # Equal NaNs would compare unequal and hide the real failure: training diverged.
        assert all(math.isfinite(x) for x in out["uninterrupted"] + out["resumed"]), (
            f"{kind} at W={world}: non-finite loss (training diverged): "
            f"uninterrupted {out['uninterrupted']}, resumed {out['resumed']}")
        assert out["resumed"] == out["uninterrupted"]
