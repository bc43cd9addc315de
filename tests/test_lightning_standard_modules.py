"""A LightningModule that builds a plain torch model in ``configure_model`` (embedding,
``nn.MultiheadAttention`` blocks, LayerNorm, Linear) trains under ``plait_zero3``,
``plait_zero3_offload`` and ``plait_zero2`` with the loss curve of ``ddp``: no ``init_fn`` needed,
the same initialisation as the DDP run (the strategies' ``configure_model`` runs the modules' own
constructors under ``sharded_init``), and no rank ever holds the whole model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.testing import run_distributed
from plait.lightning.demo import TinyLlamaModule
from plait.zero_sharding import ConstructedParameter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "lightning" / "tests"))
from test_lightning_distributed import STEPS, _close, _fit, _quiet

VOCAB, DIM, HEADS = 259, 32, 4
STRATEGIES = ("ddp", "plait_zero3", "plait_zero3_offload", "plait_zero2")


class AttentionLM(nn.Module):
    """Two blocks of ``nn.MultiheadAttention`` + MLP with LayerNorms, an embedding with a padding
    index and an untied head: only standard torch modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=258)
        self.attn = nn.ModuleList(nn.MultiheadAttention(DIM, HEADS, batch_first=True) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(4))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                  for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        x = self.embed(input_ids)
        mask = torch.triu(torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool), 1)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlps)):
            h = self.norms[2 * i](x)
            x = x + attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            x = x + mlp(self.norms[2 * i + 1](x))
        logits = self.head(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return type("Output", (), {"loss": loss, "logits": logits})()


class AttentionModule(TinyLlamaModule):
    """The demo module's data, optimizer and schedule around :class:`AttentionLM`, built in
    ``configure_model``; records whether every parameter was built sliced."""

    built_sliced: bool | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, in_configure_model=True, **kwargs)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = AttentionLM()

    def configure_optimizers(self) -> Any:
        # After configure_model's context closed and before ZeRO shards: every parameter sliced.
        AttentionModule.built_sliced = all(isinstance(p, ConstructedParameter) for p in self.model.parameters())
        return super().configure_optimizers()


def session() -> dict[str, Any]:
    """Every strategy on this rank (module level: run_distributed imports it in each rank)."""
    _quiet()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        AttentionModule.built_sliced = None
        out[name], _ = _fit(name, devices=2, steps=STEPS, module_cls=AttentionModule)
        out[f"{name}:sliced"] = AttentionModule.built_sliced
    return out


@pytest.mark.timeout(420)
def test_standard_torch_modules_train_like_ddp_under_every_plait_strategy(tmp_path: Any) -> None:
    results = run_distributed(session, 2, timeout=360, env={"PLAIT_OFFLOAD_PATH": str(tmp_path)})
    for result in results:
        ddp = result["ddp"]
        assert len(ddp) == STEPS and ddp[STEPS - 1] < ddp[0]
        assert result["ddp:sliced"] is False  # DDP builds the model whole
        for name in STRATEGIES[1:]:
            assert result[f"{name}:sliced"] is True, name
            assert result[name][0] == ddp[0], f"{name}: the first loss must be DDP's exactly (same initialisation)"
            _close(result[name], ddp)
