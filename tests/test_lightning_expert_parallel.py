"""Lightning Trainer (and Fabric) with ``PlaitStrategy(ep_size=2)`` (cross-package: plait-lightning + plait-moe-layers):
dp 2 x ep 2 on 4 gloo ranks follows Lightning's ``ddp`` with the same MoE model, and its checkpoint
holds every expert under its global name.

The model is tiny-llama-MoE with its loop MoE MLPs converted to plait MoE layers (4 experts, top-2,
dropless), as in ``test_moe_zero.py``. Under ``ep_size=2`` each rank keeps 2 of the 4 experts of
every MoE layer; ZeRO-3 shards the dense parameters over the 4 ranks and the experts over their
expert-data-parallel pair. ``ddp`` holds every expert on every rank. Both see the same data (each
rank its own sequence of the step's 4). Last, ``sp_size=2`` with ``ep_size=2`` (dp 1 x ep 2 x sp 2,
needs plait-ulysses-sp and transformers too) on a tiny HF Mixtral converted to plait MoE layers.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("plait.moe_layers")

from plait.kernels.testing import run_distributed, tiny_llama_moe  # noqa: E402
from plait.moe_layers.tiny_llama import convert_tiny_llama_moe  # noqa: E402

STEPS, SEQ, ITEMS = 3, 16, 4  # the same 4 sequences every step, so the loss falls
RESUMED = 5  # the checkpoint saved after STEPS is resumed up to this step
MODEL = dict(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=48, vocab_size=300, num_experts=4)
# fp32, same data and seed; experts run on rows gathered from the ep group (moe_expert_parallel:
# grouped by source rank, router gradient summed over ranks), so the last bits differ from ddp's.
# Measured here: the 3 losses equal ddp's bitwise (max relative difference 0.0); sp 2 x ep 2 on a
# tiny Mixtral: 2.2e-7.
RTOL = 2e-5
EXPERTS = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences (ids are also the labels)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, MODEL["vocab_size"], (ITEMS, SEQ), generator=gen)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class MoELM(L.LightningModule):
    """A plain LightningModule around a model with plait MoE layers (nothing expert-parallel in it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tiny_llama_moe(**MODEL)
        convert_tiny_llama_moe(self.model)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Tokens(), batch_size=1)


def _fit(strategy: Any, steps: int = STEPS, ckpt_path: str | None = None) -> tuple[dict[int, float], MoELM, Any]:
    from plait.lightning.demo import LossRecorder

    module = MoELM()
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, callbacks=[recorder],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, ckpt_path=ckpt_path)
    return recorder.losses, module, trainer


def _fabric_ep() -> dict[int, float]:
    """The same training as a Fabric loop with PlaitFabricStrategy(ep_size=2)."""
    from plait.lightning import PlaitFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=PlaitFabricStrategy(ep_size=2), precision="32-true")
    fabric.launch()
    model = MoELM().model
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(Tokens(), batch_size=1))
    losses = {}
    for step in range(STEPS):
        batch = next(iter(loader))
        loss = model(batch["input_ids"], labels=batch["labels"]).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
    return losses


def ep_session(root: str) -> dict[str, Any]:
    """ddp, then PlaitStrategy(ep_size=2), whose final state is saved as a Lightning checkpoint."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import plait.lightning  # noqa: F401
    from plait.lightning import PlaitStrategy
    from plait.moe_layers import moe_layers

    ddp, ddp_module, _ = _fit("ddp")
    ddp_experts = {name: ddp_module.state_dict()[name].clone() for name in EXPERTS}
    ddp_longer = _fit("ddp", steps=RESUMED)[0]
    ours, module, trainer = _fit(PlaitStrategy(ep_size=2))
    trainer.save_checkpoint(f"{root}/ep2.ckpt")
    layers = moe_layers(module)
    mesh = trainer.strategy.device_mesh
    # the ep=2 checkpoint resumed at ep=4 (one expert per rank) continues ddp's curve
    resumed = _fit(PlaitStrategy(ep_size=4), steps=RESUMED, ckpt_path=f"{root}/ep2.ckpt")[0]
    return {"ddp": ddp, "ep": ours, "ddp_experts": ddp_experts, "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
            "local_experts": [(layer.ep_size, layer.experts.first_expert, layer.experts.local_experts)
                              for layer in layers], "fabric": _fabric_ep(), "ddp_longer": ddp_longer,
            "resumed_ep4": resumed}


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("lightning-ep")
    return run_distributed(ep_session, 4, str(root), timeout=240), root


@pytest.mark.timeout(300)
def test_trainer_ep2_follows_ddp(ep_run: tuple[list[dict[str, Any]], Path]) -> None:
    results, _ = ep_run
    for rank, result in enumerate(results):
        assert result["mesh"] == (("dp", "ep"), (2, 2)), result["mesh"]
        assert result["local_experts"] == [(2, 2 * (rank % 2), 2)], result["local_experts"]  # 2 of 4 experts
        ddp, ep = result["ddp"], result["ep"]
        assert sorted(ddp) == sorted(ep) == list(range(STEPS)), (ddp, ep)
        assert ddp[STEPS - 1] < ddp[0]
        for step in range(STEPS):
            assert math.isclose(ep[step], ddp[step], rel_tol=RTOL), (rank, step, ep, ddp)
            assert math.isclose(result["fabric"][step], ddp[step], rel_tol=RTOL), (rank, step, result["fabric"], ddp)
    print("ddp", results[0]["ddp"], "ep", results[0]["ep"],
          "max rel", max(abs(results[0]["ep"][s] / results[0]["ddp"][s] - 1) for s in range(STEPS)))


@pytest.mark.timeout(300)
def test_ep2_checkpoint_holds_every_expert_under_its_global_name(ep_run: tuple[list[dict[str, Any]], Path]) -> None:
    from plait.lightning import consolidated_state_dict

    results, root = ep_run
    weights = consolidated_state_dict(root / "ep2.ckpt")
    want = MoELM().state_dict()  # every name and whole shape of the unsharded model
    assert weights.keys() == want.keys(), sorted(set(weights) ^ set(want))
    for name in want:
        assert weights[name].shape == want[name].shape, (name, weights[name].shape, want[name].shape)
    for name in EXPERTS:
        assert weights[name].shape[0] == MODEL["num_experts"]
        # all 4 experts, each equal to ddp's trained one (so the blocks sit at their global rows)
        torch.testing.assert_close(weights[name], results[0]["ddp_experts"][name], rtol=1e-4, atol=1e-6)
        assert not torch.equal(weights[name], want[name])  # trained, not the initial weights


@pytest.mark.timeout(300)
def test_ep2_checkpoint_resumes_at_ep4_on_the_ddp_curve(ep_run: tuple[list[dict[str, Any]], Path]) -> None:
    results, _ = ep_run
    for rank, result in enumerate(results):
        resumed, ddp = result["resumed_ep4"], result["ddp_longer"]
        assert sorted(resumed) == list(range(STEPS, RESUMED)), resumed
        for step in resumed:
            assert math.isclose(resumed[step], ddp[step], rel_tol=RTOL), (rank, step, resumed, ddp)


def test_ep_size_not_dividing_the_world_is_refused_before_processes_start() -> None:
    import plait.lightning  # noqa: F401
    from plait.lightning import PlaitStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PlaitStrategy(ep_size=4), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"ep_size=4 does not divide the world size 2"):
        trainer.fit(MoELM())


MIXTRAL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=96,
               num_hidden_layers=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2)


class MixtralTokens(torch.utils.data.Dataset):
    """Fixed random 15-token sequences for the Mixtral model (odd: padded to 16 under sp=2)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, MIXTRAL["vocab_size"], (ITEMS, 15), generator=gen)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class MixtralLM(L.LightningModule):
    """A tiny HF Mixtral whose sparse blocks are converted to plait MoE layers; a plain user module."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        import transformers

        from plait.moe_layers.hf import convert_hf_moe

        torch.manual_seed(0)
        config = transformers.MixtralConfig(**MIXTRAL)
        config._attn_implementation = "sdpa"
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        convert_hf_moe(self.model)
        self.batch_size = batch_size

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(MixtralTokens(), batch_size=self.batch_size)


def sp_ep_session() -> dict[str, Any]:
    """ddp (4 ranks x 1 sequence), then PlaitStrategy(sp_size=2, ep_size=2): dp 1 x ep 2 x sp 2."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import plait.lightning  # noqa: F401
    from plait.lightning import PlaitStrategy
    from plait.lightning.demo import LossRecorder

    out: dict[str, Any] = {}
    for key, strategy, batch_size in (("ddp", "ddp", 1), ("sp_ep", PlaitStrategy(sp_size=2, ep_size=2), 2)):
        module, recorder = MixtralLM(batch_size), LossRecorder()
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, callbacks=[recorder],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module)
        out[key] = recorder.losses
    from plait.moe_layers import moe_layers
    from plait.ulysses_sp.hf import is_ulysses

    mesh = trainer.strategy.device_mesh
    out["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape))
    out["applied"] = (is_ulysses(module.model), [layer.ep_size for layer in moe_layers(module)])
    return out


@pytest.mark.timeout(300)
def test_trainer_sp2_with_ep2_follows_ddp() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("plait.ulysses_sp")
    results = run_distributed(sp_ep_session, 4, timeout=240)
    for rank, result in enumerate(results):
        assert result["mesh"] == (("dp", "ep", "sp"), (1, 2, 2)), result["mesh"]
        assert result["applied"] == (True, [2, 2]), result["applied"]  # Ulysses, and 2 MoE layers at ep 2
        ddp, ours = result["ddp"], result["sp_ep"]
        assert sorted(ddp) == sorted(ours) == list(range(STEPS)), (ddp, ours)
        assert ddp[STEPS - 1] < ddp[0]
        for step in range(STEPS):
            assert math.isclose(ours[step], ddp[step], rel_tol=RTOL), (rank, step, ours, ddp)
    print("ddp", results[0]["ddp"], "sp+ep", results[0]["sp_ep"],
          "max rel", max(abs(results[0]["sp_ep"][s] / results[0]["ddp"][s] - 1) for s in range(STEPS)))
