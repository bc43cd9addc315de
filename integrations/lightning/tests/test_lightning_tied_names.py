"""A tied head (``head.weight`` is ``wte.weight``) keeps both names through the plait strategies.

One 2-rank gloo session trains a tiny GPT under Lightning's ``ddp`` and under ``plait_zero2`` /
``plait_zero3`` and saves each; the tests then check that the consolidated and exported weights
have every key the model's own ``state_dict`` has, load strictly, and equal ``ddp``'s bitwise.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from plait.kernels.testing import run_distributed

STEPS = 3
STRATEGIES = ("plait_zero2", "plait_zero3")


class TiedGPT(nn.Module):
    """Embedding, one MLP block and a head sharing the embedding's weight."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        return self.head(x + self.block(x))


def _module_class() -> type:
    import lightning as L

    class TiedModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TiedGPT()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(batch_idx)
            ids = torch.randint(0, 64, (4, 9), generator=g)[self.global_rank * 2:(self.global_rank + 1) * 2]
            logits = self(ids[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(ids)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(list(range(STEPS * 2)), batch_size=1)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return TiedModule


def session(root: str) -> dict[str, Any]:
    """Train and save under each strategy; rank 0 returns ddp's state dict."""
    warnings.filterwarnings("ignore")
    import lightning as L

    import plait.lightning  # noqa: F401

    out: dict[str, Any] = {}
    for name in ("ddp", *STRATEGIES):
        L.seed_everything(0, verbose=False)
        module = _module_class()()
        trainer = L.Trainer(devices=2, strategy=name, max_steps=STEPS, accelerator="cpu", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False)
        trainer.fit(module)
        trainer.save_checkpoint(f"{root}/{name}.ckpt")
        if name == "ddp":
            out["ddp"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("tied"))
    return {"root": root, **run_distributed(session, 2, root, timeout=240)[0]}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_consolidated_state_dict_has_every_name_bitwise_ddp(runs: dict[str, Any], strategy: str) -> None:
    from plait.lightning import consolidated_state_dict

    ddp = runs["ddp"]
    assert "model.head.weight" in ddp and "model.wte.weight" in ddp
    got = consolidated_state_dict(f"{runs['root']}/{strategy}.ckpt")
    assert sorted(got) == sorted(ddp)
    for name, value in ddp.items():
        assert torch.equal(got[name], value), name
    fresh = TiedGPT()
    fresh.load_state_dict(consolidated_state_dict(f"{runs['root']}/{strategy}.ckpt", strip="model."), strict=True)
    assert fresh.head.weight is fresh.wte.weight and torch.equal(fresh.head.weight, ddp["model.wte.weight"])


def test_exported_weights_have_every_name(runs: dict[str, Any], tmp_path: Any) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file

    from plait.lightning import export_weights

    out = export_weights(f"{runs['root']}/plait_zero3.ckpt", tmp_path / "hf", strip="model.")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        weights.update(load_file(shard))
    ddp = {k[len("model."):]: v for k, v in runs["ddp"].items()}
    assert sorted(weights) == sorted(ddp)
    assert all(torch.equal(weights[k], v) for k, v in ddp.items())
    TiedGPT().load_state_dict(weights, strict=True)
