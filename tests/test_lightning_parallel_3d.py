"""3-D parallelism in the Lightning Trainer: ``PlaitStrategy(pp_size=2, tp_size=2)`` (cross-package:
plait-lightning + plait-zero-sharding + plait-universal-ckpt), 4 gloo ranks, in one launch.

The LightningModule is the pipelined one of ``test_lightning_pipeline_parallel.py`` (four
Linear+Tanh blocks, two per stage, 1F1B over two microbatches, ZeRO-3, manual optimization) whose
``configure_model`` also applies a TP plan to its stage on ``self.device_mesh["tensor_parallel"]``
(each stage's first Linear ``ColwiseParallel``, its second ``RowwiseParallel``) and sets
``self.pipeline_name_map``.

* ``dp1 x pp2 x tp2``: the mesh is ``(data_parallel 1, pipeline_parallel 2, tensor_parallel 2)``,
  the sampler splits over dp only, and 4 steps follow one process within 1e-5 relative.
* its step-2 checkpoint (``ModelCheckpoint``) resumes at the same layout with bitwise the same
  losses at steps 3-4, and the step-4 checkpoint exports whole weights (``consolidated_state_dict``)
  that load strictly into the whole model and equal one process's within 1e-5.
* gradient clipping (``pipeline_step(..., gradient_clip_val=...)`` at a value below every step's
  norm) at ``dp1 x pp2 x tp2`` and ``dp2 x pp2``: the norm every rank reports is the whole
  model's (across stages, tp and dp) as ``torch.nn.utils.clip_grad_norm_`` gives it on one
  process, within 1e-5, and the clipped losses follow one process within 1e-5.

Bad input is refused before any process starts, naming the field: ``tp_size x pp_size`` not dividing
the world size, and ``Trainer(gradient_clip_val=...)`` (which Lightning refuses under manual
optimization only inside the ranks) with the way to clip instead.
"""

from __future__ import annotations

import math
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
CLIP = 0.05  # below every step's gradient norm of this model: clipping acts on every step


class Stages3D(PipelinedRegression):
    """The pipelined module, its stage tensor-parallel (when the mesh has tp) and its names mapped
    to the whole model's; with ``clip``, ``pipeline_step`` clips and the norms are recorded."""

    def __init__(self, clip: float | None = None) -> None:
        super().__init__()
        self.clip = clip
        self.norms: dict[int, float] = {}

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from plait.universal_ckpt import layer_offset

        if self.stage is not None:
            return
        super().configure_model()
        if "tensor_parallel" in self.device_mesh.mesh_dim_names:
            parallelize_module(self.stage, self.device_mesh["tensor_parallel"],
                               {"0.0": ColwiseParallel(), "1.0": RowwiseParallel()})
        self.pipeline_name_map = layer_offset("stage.", 2 * self.device_mesh["pipeline_parallel"].get_local_rank())

    def training_step(self, batch: Any, batch_idx: int) -> None:
        from plait.lightning.pipeline_parallel import pipeline_step

        x, y = batch
        loss = pipeline_step(self, x, y, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss,
                             gradient_clip_val=self.clip)
        self.losses[self.trainer.global_step - 1] = float(loss)
        self.norms[self.trainer.global_step - 1] = float(self.optimizers().optimizer.last_grad_norm)


def _trainer(root: str, tp_size: int, callbacks: tuple = ()) -> Any:
    from plait.lightning import PlaitStrategy
    from plait.zero_sharding import ZeroConfig

    return L.Trainer(accelerator="cpu", devices=4, max_steps=STEPS, logger=False,
                     strategy=PlaitStrategy(zero=ZeroConfig(stage=3), pp_size=2, tp_size=tp_size),
                     enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root)


def _session(tmp: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from plait.lightning import consolidated_state_dict

    saves = ModelCheckpoint(dirpath=f"{tmp}/straight", filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1)
    straight = Stages3D()
    trainer = _trainer(tmp, 2, (saves,))
    trainer.fit(straight)
    resumed = Stages3D()
    _trainer(tmp, 2).fit(resumed, ckpt_path=f"{tmp}/straight/step={SAVE_AT}.ckpt")
    clipped = {tp: Stages3D(clip=CLIP) for tp in (2, 1)}  # dp1 x pp2 x tp2, dp2 x pp2
    for tp, module in clipped.items():
        _trainer(tmp, tp).fit(module)
    mesh, sampler = trainer.strategy.device_mesh, trainer.strategy.distributed_sampler_kwargs
    out: dict[str, Any] = {"rank": dist.get_rank(), "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
                           "sampler": (sampler["num_replicas"], sampler["rank"]), "straight": straight.losses,
                           "resumed": resumed.losses,
                           "clipped": {tp: (m.losses, m.norms) for tp, m in clipped.items()}}
    if dist.get_rank() == 0:
        out["weights"] = consolidated_state_dict(f"{tmp}/straight/step={STEPS}.ckpt", strip="stage.")
    return out


def _one_process(dp: int, clip: float | None = None) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The whole model on every dp rank's batches: the losses (each pipeline's sum of microbatch
    losses, averaged over dp), the gradient norms before clipping and the final parameters."""
    data, model = Pairs(), build_blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    size, batches = PER_RANK // MICROBATCHES, ITEMS // dp // PER_RANK
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for rank in range(dp):  # this dp rank's batch: Lightning's training sampler shuffles, seed 0, per epoch
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(step // batches)
            rows = list(sampler)[(step % batches) * PER_RANK:][:PER_RANK]
            for m in range(MICROBATCHES):
                pick = rows[m * size:(m + 1) * size]
                total = total + nn.functional.mse_loss(model(data.x[pick]), data.y[pick])
        loss = total / dp
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(600)
def test_3d_parallelism_in_the_trainer_follows_one_process_resumes_and_clips(tmp_path) -> None:
    results = run_distributed(_session, 4, str(tmp_path), timeout=560)
    reference, _, reference_weights = _one_process(1)
    for result in results:
        assert result["mesh"] == (("data_parallel", "pipeline_parallel", "tensor_parallel"), (1, 2, 2)), result
        assert result["sampler"] == (1, 0), result["sampler"]  # one dp rank: every rank reads every batch
        assert sorted(result["resumed"]) == list(range(SAVE_AT, STEPS)), result["resumed"]
        for step in range(SAVE_AT, STEPS):  # same layout: bit for bit
            assert result["resumed"][step] == result["straight"][step], (step, result)
        for step in range(STEPS):
            assert math.isclose(result["straight"][step], reference[step], rel_tol=TOL), (step, result, reference)
    for tp, dp in ((2, 1), (1, 2)):
        losses, norms, _ = _one_process(dp, CLIP)
        assert all(norm > CLIP for norm in norms), norms
        for result in results:
            ours_losses, ours_norms = result["clipped"][tp]
            for step in range(STEPS):
                assert math.isclose(ours_norms[step], norms[step], rel_tol=TOL), (tp, step, ours_norms, norms)
        for step in range(STEPS):  # the pipelines' losses averaged over dp (ranks [0, 2] or [0])
            mean = sum(r["clipped"][tp][0][step] for r in results[::2 * tp]) / dp
            assert math.isclose(mean, losses[step], rel_tol=TOL), (tp, step, mean, losses)
    exported = build_blocks()
    exported.load_state_dict(results[0]["weights"], strict=True)
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, reference_weights[name], rtol=TOL, atol=TOL)


def test_bad_3d_settings_are_refused_before_any_work() -> None:
    from plait.lightning import PlaitStrategy

    def fit(strategy: Any, **trainer: Any) -> None:
        L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, **trainer).fit(Stages3D())

    with pytest.raises(ValueError, match=r"tp_size=4 x pp_size=2 = 8 does not divide the world size 4 \(devices x "
                                         r"num_nodes\); make the product one of \[1, 2, 4\]"):
        fit(PlaitStrategy(pp_size=2, tp_size=4))
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the world size 4"):
        fit(PlaitStrategy(pp_size=2, tp_size=3))
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=1.0\) with PlaitStrategy\(pp_size=2\).*"
                                         r"pipeline_step\(.*gradient_clip_val=1.0\)"):
        fit(PlaitStrategy(pp_size=2, tp_size=2), gradient_clip_val=1.0)
