"""Lightning Trainer (and Fabric) with ``PlaitStrategy(sp_size=2)`` (cross-package: plait-lightning + plait-ulysses-sp
+ transformers): dp 2 x sp 2 on 4 gloo ranks follows Lightning's ``ddp`` on the same global batches.

The LightningModule is the plain one a user writes for an HF causal LM (``self.model(**batch).loss``,
logged with ``sync_dist=True``); nothing in it knows about sequence parallelism. The strategy samples
over the 2 dp ranks (each sp pair loads the same 2 sequences), keeps each rank's half of the
sequence (17 tokens, padded to 18), gives the model Ulysses attention and ulysses-sp's loss. The
reference is ``ddp`` on 4 ranks, one sequence each: the same 4 sequences per step. A Fabric loop
with ``PlaitFabricStrategy(sp_size=2)`` and ``fabric.strategy.split_batch`` follows the same curve.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("plait.ulysses_sp")
L = pytest.importorskip("lightning")

from plait.kernels.testing import run_distributed  # noqa: E402

STEPS, SEQ, ITEMS = 3, 17, 4  # the same 4 sequences every step, so the loss falls
# fp32, same data and seed: as test_lightning_distributed's RTOL for ZeRO vs ddp, but the loss and
# gradients are now also summed over sequence slices (ulysses_model_grad: sums split across ranks);
# measured here: max relative difference 1.2e-7 over the 3 steps.
RTOL = 2e-5
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences (ids are also the labels)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, CONFIG["vocab_size"], (ITEMS, SEQ), generator=gen)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class HFCausalLM(L.LightningModule):
    """A user's plain HF LightningModule (nothing sequence-parallel in it)."""

    def __init__(self, batch_size: int, in_configure_model: bool = False) -> None:
        super().__init__()
        self.model = None if in_configure_model else self.build()
        self.batch_size = batch_size
        self.local_lengths: list[int] = []

    @staticmethod
    def build() -> Any:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**CONFIG)
        config._attn_implementation = "sdpa"
        return transformers.AutoModelForCausalLM.from_config(config)

    def configure_model(self) -> None:
        if self.model is None:  # under the strategy's sharded construction: no rank holds it whole
            self.model = self.build()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.local_lengths.append(int(batch["input_ids"].shape[1]))
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size)


def _fit(strategy: Any, batch_size: int, **module_kwargs: Any) -> tuple[dict[int, float], HFCausalLM, Any]:
    from plait.lightning.demo import LossRecorder

    module = HFCausalLM(batch_size, **module_kwargs)
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, callbacks=[recorder],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(module)
    return recorder.losses, module, trainer


def _fabric_sp() -> dict[int, float]:
    """The same training as a Fabric loop: the user's loop passes each batch through split_batch."""
    from plait.lightning import PlaitFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=PlaitFabricStrategy(sp_size=2), precision="32-true")
    fabric.launch()
    model = HFCausalLM(2).model
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(Tokens(), batch_size=2))
    losses = {}
    for step in range(STEPS):
        batch = fabric.strategy.split_batch(next(iter(loader)))
        loss = model(**batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
    return losses


def sp_session() -> dict[str, Any]:
    """ddp (4 ranks x 1 sequence) then PlaitStrategy(sp_size=2) (2 dp ranks x 2 sequences, halves)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import plait.lightning  # noqa: F401
    from plait.lightning import PlaitStrategy

    ddp, _, ddp_trainer = _fit("ddp", batch_size=1)
    ours, module, trainer = _fit(PlaitStrategy(sp_size=2), batch_size=2)
    mesh = trainer.strategy.device_mesh
    from plait.ulysses_sp.hf import is_ulysses

    applied = (module.model.config._attn_implementation, is_ulysses(module.model))
    from plait.lightning.parallel import remove_sequence_parallel

    remove_sequence_parallel(module)
    removed = (module.model.config._attn_implementation, is_ulysses(module.model),
               "_loss_function" in vars(module.model))
    return {"ddp": ddp, "sp": ours, "lengths": module.local_lengths, "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
            "applied": applied, "removed": removed,
            "configure_model": _fit(PlaitStrategy(sp_size=2), batch_size=2, in_configure_model=True)[0],
            "fabric": _fabric_sp(), "val": (float(ddp_trainer.callback_metrics["val_loss"]),
                                            float(trainer.callback_metrics["val_loss"]))}


@pytest.mark.timeout(300)
def test_trainer_sp2_follows_ddp_on_the_same_global_batches() -> None:
    results = run_distributed(sp_session, 4, timeout=240)
    for rank, result in enumerate(results):
        assert result["mesh"] == (("dp", "sp"), (2, 2)), result["mesh"]
        assert result["applied"] == ("plait_ulysses", True), result["applied"]
        assert result["removed"] == ("sdpa", False, False), result["removed"]  # own attention and loss back
        assert result["lengths"] == [9] * STEPS, result["lengths"]  # 17 tokens padded to 18, halves
        assert math.isclose(*result["val"], rel_tol=RTOL), result["val"]  # validation batches are split too
        ddp, sp = result["ddp"], result["sp"]
        assert sorted(ddp) == sorted(sp) == list(range(STEPS)), (ddp, sp)
        assert ddp[STEPS - 1] < ddp[0]
        for step in range(STEPS):
            assert math.isclose(sp[step], ddp[step], rel_tol=RTOL), (rank, step, sp, ddp)
            assert math.isclose(result["fabric"][step], ddp[step], rel_tol=RTOL), (rank, step, result["fabric"], ddp)
            built = result["configure_model"]  # the HF model built in configure_model (sliced), then Ulysses
            assert math.isclose(built[step], ddp[step], rel_tol=RTOL), (rank, step, built, ddp)
    print("ddp", results[0]["ddp"], "sp", results[0]["sp"],
          "max rel", max(abs(results[0]["sp"][s] / results[0]["ddp"][s] - 1) for s in range(STEPS)))


def test_sp_size_not_dividing_the_world_is_refused_before_processes_start() -> None:
    import plait.lightning
    from plait.lightning import PlaitStrategy

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=PlaitStrategy(sp_size=3), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"sp_size=3 does not divide the world size 4"):
        trainer.fit(HFCausalLM(1))
    fabric = None
    with pytest.raises(ValueError, match=r"sp_size=3 does not divide the world size 2"):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=plait.lightning.PlaitFabricStrategy(sp_size=3))
    assert fabric is None
