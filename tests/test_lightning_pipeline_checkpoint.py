"""Checkpoints of a Lightning ``PlaitStrategy(pp_size=2)`` run (cross-package: plait-lightning +
plait-zero-sharding + plait-universal-ckpt), dp 2 x pp 2 on 4 gloo ranks, in one launch.

The LightningModule is the one of ``test_lightning_pipeline_parallel.py`` (four Linear+Tanh
blocks, two per stage, numbered from 0 in each stage, ZeRO-3 over each stage's dp pair, 1F1B over
two microbatches) plus ``self.pipeline_name_map`` (``layer_offset("stage.", 2 * stage)``), so the
checkpoint holds the whole model's names.

* The 4-step run follows one process: each pipeline's loss (the sum of its microbatches' losses),
  averaged over dp, within 1e-5 relative; the strategy's mesh is ``(data_parallel 2,
  pipeline_parallel 2)``, the LightningModule is ZeRO-sharded and the sampler splits over dp only.
* ``ModelCheckpoint`` saves at steps 2 and 4 of that run; a new Trainer resumed from step 2
  (``ckpt_path=``) at the same layout gives bitwise the same losses at steps 3-4 and a step-4
  checkpoint with bitwise the same whole parameters.
* The step-2 checkpoint resumes at dp 4 x pp 1: a LightningModule that builds the whole model under
  the strategy without ``pp_size`` and automatic optimization (each rank a microbatch-sized batch,
  its loss scaled as the pipeline sums its microbatches); it runs steps 3-4 only (the step count
  the pipeline's manual optimization saved is carried over) and its losses follow one process
  within 1e-5 relative.
* The step-4 checkpoint exports as a plain torch state dict (``consolidated_state_dict``) that
  loads strictly into the whole ``nn.Sequential`` and equals one process's parameters within 1e-5.
* Without ``pipeline_name_map`` the two stages' names collide: the save is refused on every rank,
  naming the attribute, and nothing is written at the path.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

sys.path.insert(0, str(Path(__file__).parent))
from test_lightning_pipeline_parallel import (  # noqa: E402
    ITEMS,
    MICROBATCHES,
    PER_RANK,
    TOL,
    Pairs,
    PipelinedRegression,
    build_blocks,
)

from plait.kernels.testing import run_distributed  # noqa: E402

STEPS, SAVE_AT = 4, 2


class NamedStages(PipelinedRegression):
    """The pipelined module, its stage's names mapped to the whole model's."""

    def configure_model(self) -> None:
        from plait.universal_ckpt import layer_offset

        super().configure_model()
        self.pipeline_name_map = layer_offset("stage.", 2 * self.device_mesh["pipeline_parallel"].get_local_rank())


class WholeModel(L.LightningModule):
    """The same model whole (dp 4 x pp 1): each rank takes ``PER_RANK // MICROBATCHES`` items, and
    its loss is the microbatch loss times ``MICROBATCHES``, as a pipeline sums its microbatches'."""

    def __init__(self) -> None:
        super().__init__()
        self.stage: nn.Module | None = None
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if self.stage is None:
            self.stage = build_blocks()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = MICROBATCHES * nn.functional.mse_loss(self.stage(x), y)
        self.losses[self.trainer.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Pairs(), batch_size=PER_RANK // MICROBATCHES)


def _trainer(root: str, pp_size: int, max_steps: int, callbacks: tuple = ()) -> Any:
    from plait.lightning import PlaitStrategy
    from plait.zero_sharding import ZeroConfig

    return L.Trainer(accelerator="cpu", devices=4, strategy=PlaitStrategy(zero=ZeroConfig(stage=3), pp_size=pp_size),
                     max_steps=max_steps, logger=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     default_root_dir=root)


def _checkpoint_session(tmp: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from plait.lightning import consolidated_state_dict
    from plait.zero_sharding import ZeroModule

    saves = ModelCheckpoint(dirpath=f"{tmp}/straight", filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1)
    straight = NamedStages()
    trainer = _trainer(tmp, 2, STEPS, (saves,))
    trainer.fit(straight)
    step2, step4 = f"{tmp}/straight/step={SAVE_AT}.ckpt", f"{tmp}/straight/step={STEPS}.ckpt"

    resumed = NamedStages()
    _trainer(tmp, 2, STEPS).fit(resumed, ckpt_path=step2)
    resumed_trainer = resumed.trainer
    resumed_trainer.save_checkpoint(f"{tmp}/resumed.ckpt")

    whole = WholeModel()
    _trainer(tmp, 1, STEPS).fit(whole, ckpt_path=step2)

    mesh, sampler = trainer.strategy.device_mesh, trainer.strategy.distributed_sampler_kwargs
    facts = {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape)), "sharded": isinstance(straight, ZeroModule),
             "sampler": (sampler["num_replicas"], sampler["rank"])}
    straight.pipeline_name_map = None  # the stages' own names: stage 0 and stage 1 both have stage.0.0.weight
    try:
        trainer.save_checkpoint(f"{tmp}/unnamed.ckpt")
        refused = None
    except ValueError as exc:
        refused = str(exc)
    out: dict[str, Any] = {"rank": dist.get_rank(), "straight": straight.losses, "resumed": resumed.losses,
                           "whole": whole.losses, "refused": refused,
                           "unnamed_written": Path(f"{tmp}/unnamed.ckpt").exists(), **facts}
    if dist.get_rank() == 0:
        out["weights"] = consolidated_state_dict(step4, strip="stage.")
        out["resumed_weights"] = consolidated_state_dict(f"{tmp}/resumed.ckpt", strip="stage.")
    return out


def _one_process() -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The whole model on both dp ranks' batches (see ``test_lightning_pipeline_parallel.one_process``),
    with its final parameters."""
    data, model = Pairs(), build_blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    size = PER_RANK // MICROBATCHES
    losses = {}
    for step in range(STEPS):
        total = 0.0
        for rank in range(2):
            rows = list(range(rank, ITEMS, 2))
            for m in range(MICROBATCHES):
                pick = rows[m * size:(m + 1) * size]
                total = total + nn.functional.mse_loss(model(data.x[pick]), data.y[pick])
        loss = total / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(420)
def test_pp_checkpoint_resumes_bitwise_reshards_and_exports(tmp_path) -> None:
    results = run_distributed(_checkpoint_session, 4, str(tmp_path), timeout=400)
    reference, reference_weights = _one_process()
    for result in results:
        assert result["mesh"] == (("data_parallel", "pipeline_parallel"), (2, 2)), result["mesh"]
        assert result["sharded"], "the stage's LightningModule is sharded by ZeRO"
        assert result["sampler"] == (2, result["rank"] // 2), result["sampler"]
        # same layout: the resumed steps are the uninterrupted ones, bit for bit
        assert sorted(result["resumed"]) == list(range(SAVE_AT, STEPS)), result["resumed"]
        for step in range(SAVE_AT, STEPS):
            assert result["resumed"][step] == result["straight"][step], (step, result)
        assert result["refused"] is not None and "pipeline_name_map" in result["refused"], result["refused"]
        assert re.search(r"stages 0 and 1 both name a parameter 'stage\.[01]\.0\.", result["refused"]), result
        assert not result["unnamed_written"]
    for step in range(STEPS):  # the pipelined run follows one process (each pipeline's sum, averaged over dp)
        mean = (results[0]["straight"][step] + results[2]["straight"][step]) / 2
        assert math.isclose(mean, reference[step], rel_tol=TOL, abs_tol=TOL), (step, mean, reference)
    for result in results:  # the step count carried from manual to automatic optimization: steps 3-4 only
        assert sorted(result["whole"]) == list(range(SAVE_AT, STEPS)), result["whole"]
    for step in range(SAVE_AT, STEPS):  # dp 4 x pp 1 from the dp 2 x pp 2 checkpoint: the mean over its 4 ranks
        mean = sum(result["whole"][step] for result in results) / 4
        assert math.isclose(mean, reference[step], rel_tol=TOL, abs_tol=TOL), (step, mean, reference)
    weights, resumed_weights = results[0]["weights"], results[0]["resumed_weights"]
    assert weights.keys() == reference_weights.keys() == resumed_weights.keys(), sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor, resumed_weights[name]), name
    exported = build_blocks()
    exported.load_state_dict(weights, strict=True)
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, reference_weights[name], rtol=TOL, atol=TOL)


def _loops(manual: int, automatic: int) -> dict[str, Any]:
    """Lightning's fit-loop progress as a checkpoint holds it, with these optimizer-step counts."""
    count = {"ready": automatic, "completed": automatic}
    step = {"total": dict(count), "current": dict(count)}
    zero_grad = {part: {**count, "started": count["completed"]} for part, count in step.items()}
    return {"loops": {"fit_loop": {
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {"step": step, "zero_grad": zero_grad}},
        "epoch_loop.manual_optimization.optim_step_progress": {
            "total": {"ready": manual, "completed": manual}, "current": {"ready": manual, "completed": manual}}}}}


def test_optimizer_steps_carry_between_manual_and_automatic_optimization() -> None:
    from plait.lightning.pipeline_checkpoint import carry_optimizer_steps

    auto_key = "epoch_loop.automatic_optimization.optim_progress"
    manual_key = "epoch_loop.manual_optimization.optim_step_progress"
    pipelined = carry_optimizer_steps(_loops(manual=2, automatic=0), automatic=True)["loops"]["fit_loop"]
    assert pipelined[auto_key] == _loops(manual=0, automatic=2)["loops"]["fit_loop"][auto_key]
    plain = carry_optimizer_steps(_loops(manual=0, automatic=3), automatic=False)["loops"]["fit_loop"]
    assert plain[manual_key]["total"] == {"ready": 3, "completed": 3}
    same = carry_optimizer_steps(_loops(manual=2, automatic=0), automatic=False)
    assert same == _loops(manual=2, automatic=0), "a count already in the module's own loop is kept as it is"
    assert carry_optimizer_steps({"epoch": 1}, automatic=True) == {"epoch": 1}


def test_a_deepspeed_checkpoint_is_refused_under_pp_size(tmp_path) -> None:
    """Its names are the whole model's, a stage's are not: refused before reading, naming the way."""
    from plait.lightning import PlaitStrategy

    (tmp_path / "latest").write_text("tag")
    (tmp_path / "tag").mkdir()
    (tmp_path / "tag" / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"DeepSpeed checkpoint.*pp_size=2.*without pp_size.*pipeline_name_map"):
        PlaitStrategy(pp_size=2).load_checkpoint(tmp_path)
