"""FSDP2 + torch TP on a 2-D mesh (dp=2 x tp=2): column-parallel weights carry FSDP2's
``_StridedShard`` placement (FSDP shards the TP-local rows), row-parallel ones ``(Shard(0), Shard(1))``,
norms ``Shard(0)`` over dp only.

An HF Llama trained 3 steps this way saves with ``uc.save``; one process, torch TP=2 alone and a
fresh FSDP2 + TP model load it with every parameter and AdamW tensor bitwise the saved run's
(``full_tensor()``), and training continues with the losses of the run continuing.
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
import mp_models as mp

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("torch.distributed.tensor.parallel")

OPT = dict(lr=1e-2, weight_decay=0.1)
# Layouts that sum the row-parallel halves, or reduce gradients, in another order: float32 rounding
# carried by AdamW over 3 steps (the torch TP tests' tolerance).
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _full(value) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value.clone()


def _states(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{n}": _full(p.detach()) for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        for field, value in optimizer.state[param].items():
            out[f"optim.{field}.{name}"] = _full(value)
    return out


def _fsdp2_tp(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = mp.torch_tp(mp.llama(seed), mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def save_fsdp2_tp(root: str) -> dict:
    """FSDP2 x TP at W=4: 3 steps, save, 3 more (the reference continuation)."""
    model = _fsdp2_tp(0)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    mp.train(model, optimizer, 3)
    placements = {str(p.placements) for p in model.parameters()}
    uc.save({"model": uc.model_parallel(model, optimizer)}, root, step=3)
    return {"states": _states(model, optimizer), "next": mp.train(model, optimizer, 3), "placements": placements}


def load_fsdp2_tp(root: str) -> dict:
    """A fresh FSDP2 x TP model at W=4 (pieces into _StridedShard locals): load, train on."""
    model = _fsdp2_tp(1)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    uc.load({"model": uc.model_parallel(model, optimizer)}, root)
    return {"states": _states(model, optimizer), "next": mp.train(model, optimizer, 3)}


def load_tp2(root: str) -> dict:
    """torch TP=2 alone at W=2: load, train on."""
    from torch.distributed.device_mesh import init_device_mesh

    model = mp.torch_tp(mp.llama(1), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    config = uc.ModelParallelConfig(groups={"tp": tuple(range(dist.get_world_size()))})
    uc.load({"model": uc.model_parallel(model, optimizer, config=config)}, root)
    return {"states": _states(model, optimizer), "next": mp.train(model, optimizer, 3)}


def _assert_same_state(got: dict, saved: dict) -> None:
    assert got.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(got[name], tensor), name


def test_fsdp2_tp_strided_shard_to_one_process_tp2_and_back(tmp_path):
    saved = run_distributed(save_fsdp2_tp, 4, str(tmp_path), timeout=180)[0]
    assert any("_StridedShard" in p for p in saved["placements"]), saved["placements"]
    manifest = uc.read_manifest(uc.latest(tmp_path))
    q_pieces = sorted(p.slices for p in manifest.tensors["model/model.model.layers.0.self_attn.q_proj.weight"].pieces)
    assert q_pieces == [((0, 8), (0, 32)), ((8, 16), (0, 32)), ((16, 24), (0, 32)), ((24, 32), (0, 32))]
    assert manifest.tensors["model/model.model.layers.0.self_attn.q_proj.weight"].pattern == {
        "placements": [["dp", "_StridedShard(dim=0, sf=2)"], ["tp", "Shard(dim=0)"]]}

    model = mp.llama(1)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    uc.load({"model": uc.model_parallel(model, optimizer)}, tmp_path)
    _assert_same_state(_states(model, optimizer), saved["states"])
    torch.testing.assert_close(mp.train(model, optimizer, 3), saved["next"], **LOSS_TOLERANCE)

    for result in run_distributed(load_tp2, 2, str(tmp_path), timeout=150):
        _assert_same_state(result["states"], saved["states"])
        torch.testing.assert_close(result["next"], saved["next"], **LOSS_TOLERANCE)
    for result in run_distributed(load_fsdp2_tp, 4, str(tmp_path), timeout=180):
        _assert_same_state(result["states"], saved["states"])
        assert result["next"] == saved["next"]  # the same layout and state: the same float operations


def lone_strided_shard() -> str:
    """A _StridedShard with no later Shard of its dim: each rank holds 2 separate runs of rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 2), mesh, [_StridedShard(0, split_factor=2)],
                                                          run_check=False))
    with pytest.raises(ValueError) as info:
        uc.model_parallel(module)
    return str(info.value)


def test_strided_shard_that_is_not_a_box_is_refused():
    message = run_distributed(lone_strided_shard, 2, timeout=60)[0]
    assert "not one box" in message and "redistribute it to Shard or Replicate" in message, message
