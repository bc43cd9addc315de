"""torch.distributed.pipelining stages saved and loaded through universal checkpoints.

A traced PP=2 split (GPipe, 2 micro-batches, AdamW) trains 3 steps and saves each stage's
submodule and optimizer; the checkpoint loads into one process and into a manual PP=4 split
(layers renumbered per stage, ``layer_offset``). Every parameter and moment is bitwise the saved
stage's, and the next 3 steps give bitwise the losses the PP=2 run gives continuing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
import pipelining_models as pm

pytest.importorskip("torch.distributed.pipelining")


def save_pp2(root: str) -> dict:
    """Traced PP=2: 3 steps, save, 3 more (the reference continuation)."""
    stage, name_map = pm.traced_stage(pm.TinyLM(0), dist.get_rank(), dist.get_world_size())
    optimizer = torch.optim.AdamW(stage.submod.parameters(), **pm.ADAMW)
    pm.pipeline_train(stage, optimizer, pm.batches(1, 3))
    config = uc.ModelParallelConfig(name_map=name_map)
    uc.save({"model": uc.model_parallel(stage.submod, optimizer, config=config)}, root, step=3)
    saved = pm.states(stage.submod, optimizer, name_map)
    return {"states": saved, "next": pm.pipeline_train(stage, optimizer, pm.batches(2, 3))}


def load_manual(root: str) -> dict:
    """A manual split into world-size stages: load, then train 3 steps."""
    stage, name_map = pm.manual_stage(pm.TinyLM(1), dist.get_rank(), dist.get_world_size())
    optimizer = torch.optim.AdamW(stage.submod.parameters(), **pm.ADAMW)
    config = uc.ModelParallelConfig(name_map=name_map)
    uc.load({"model": uc.model_parallel(stage.submod, optimizer, config=config)}, root)
    loaded = pm.states(stage.submod, optimizer, name_map)
    return {"states": loaded, "next": pm.pipeline_train(stage, optimizer, pm.batches(2, 3))}


def test_pipelining_pp2_to_one_process_and_pp4(tmp_path):
    per_rank = run_distributed(save_pp2, 2, str(tmp_path), timeout=150)
    saved = {name: tensor for rank in per_rank for name, tensor in rank["states"].items()}
    expected = per_rank[-1]["next"]  # the last stage holds the losses
    assert len(expected) == 3 * pm.MICROBATCHES
    manifest = uc.read_manifest(uc.latest(tmp_path))
    assert manifest.layout.mesh == {"pp": 2}
    assert manifest.tensors["model/model.layers.3.fc.weight"].pieces[0].file == "data/rank-00001.bin"
    # Every parameter of the model, each with a step and two moments, each saved by its stage only.
    assert len(saved) == 4 * len(dict(pm.TinyLM(0).named_parameters()))

    model = pm.TinyLM(1)
    optimizer = torch.optim.AdamW(model.parameters(), **pm.ADAMW)
    uc.load({"model": uc.model_parallel(model, optimizer)}, tmp_path)
    loaded = pm.states(model, optimizer)
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    # Same state, micro-batches and gradient scaling: the same float operations in the same order.
    assert pm.single_train(model, optimizer, pm.batches(2, 3)) == expected

    per_rank = run_distributed(load_manual, 4, str(tmp_path), timeout=180)
    for rank in per_rank:
        for name, tensor in rank["states"].items():
            assert torch.equal(tensor, saved[name]), name
    assert sum(len(rank["states"]) for rank in per_rank) == len(saved)
    assert per_rank[-1]["next"] == expected
