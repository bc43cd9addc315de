"""torch's tensor parallelism (``parallelize_module``, DTensor) on a real HF Llama with AdamW:
TP=2 saves, one process and TP=2 x DP=2 load (every tensor bitwise, the moments included), and
training continues with the same losses."""

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
pytest.importorskip("torch.distributed.tensor.parallel")

OPT = dict(lr=1e-2, weight_decay=0.1)


def _full(value) -> torch.Tensor:
    # A Replicate DTensor's full_tensor() is its local tensor itself: copy, training goes on after.
    return value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()


def _states(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{n}": _full(p.detach()) for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        for field, value in optimizer.state[param].items():
            out[f"optim.{field}.{name}"] = _full(value)
    return out


def save_tp2(root: str) -> dict:
    """TP=2: train 3 steps, save, then train 3 more (the reference continuation)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = mp.torch_tp(mp.llama(0), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    mp.train(model, optimizer, 3)
    config = uc.ModelParallelConfig(groups={"tp": tuple(range(dist.get_world_size()))})
    uc.save({"model": uc.model_parallel(model, optimizer, config=config)}, root, step=3)
    states = _states(model, optimizer)
    return {"states": states, "next": mp.train(model, optimizer, 3)}


def load_tp2_dp2(root: str) -> dict:
    """TP=2 x DP=2 on a 2-D mesh: load the checkpoint, compare every tensor, train on."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = mp.torch_tp(mp.llama(1), mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    config = uc.ModelParallelConfig(groups={"tp": tuple(mesh["tp"].mesh.tolist())},
                                    replicas=tuple(mesh["dp"].mesh.tolist()))
    uc.load({"model": uc.model_parallel(model, optimizer, config=config)}, root)
    return {"states": _states(model, optimizer), "next": mp.train(model, optimizer, 3)}


def test_torch_tp_to_one_process_and_2d_mesh(tmp_path):
    saved = run_distributed(save_tp2, 2, str(tmp_path), timeout=150)[0]
    manifest = uc.read_manifest(uc.latest(tmp_path))
    pieces = manifest.tensors["model/model.model.layers.0.self_attn.o_proj.weight"].pieces
    assert sorted(p.slices for p in pieces) == [((0, 32), (0, 16)), ((0, 32), (16, 32))]  # row-parallel
    # each tensor's pattern: a DTensor's placements by mesh dimension (plait ckpt inspect shows them)
    assert manifest.tensors["model/model.model.layers.0.self_attn.o_proj.weight"].pattern == {
        "placements": [["tp", "Shard(dim=1)"]]}
    assert manifest.tensors["model/optim.exp_avg.model.layers.0.mlp.up_proj.weight"].pattern == {
        "placements": [["tp", "Shard(dim=0)"]]}
    assert len(manifest.tensors["model/model.model.norm.weight"].pieces) == 1  # replicated: written once

    model = mp.llama(1)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)  # fresh: no state until the load
    uc.load({"model": uc.model_parallel(model, optimizer)}, tmp_path)
    states = _states(model, optimizer)
    assert states.keys() == saved["states"].keys()
    for name, tensor in saved["states"].items():
        assert torch.equal(states[name], tensor), name
    # Continuing in one process vs in TP=2: the same data and state; only the order of the
    # row-parallel sums differs, so losses agree to float32 rounding over 3 steps.
    torch.testing.assert_close(mp.train(model, optimizer, 3), saved["next"], rtol=1e-5, atol=1e-6)

    for result in run_distributed(load_tp2_dp2, 4, str(tmp_path), timeout=180):
        for name, tensor in saved["states"].items():
            assert torch.equal(result["states"][name], tensor), name
        torch.testing.assert_close(result["next"], saved["next"], rtol=1e-5, atol=1e-6)


def save_tp2_sp(root: str) -> dict:
    """TP=2 with sequence parallelism (SequenceParallel norms, vocabulary-parallel embedding): 3 steps,
    save, 3 more."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = mp.torch_tp_sp(mp.llama(0), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    mp.train(model, optimizer, 3)
    config = uc.ModelParallelConfig(groups={"tp": tuple(range(dist.get_world_size()))})
    uc.save({"model": uc.model_parallel(model, optimizer, config=config)}, root, step=3)
    return {"states": _states(model, optimizer), "next": mp.train(model, optimizer, 3)}


def test_torch_tp_sequence_parallel_to_one_process(tmp_path):
    """Sequence parallelism shards activations, not state: its norms are Replicate DTensors saved once."""
    saved = run_distributed(save_tp2_sp, 2, str(tmp_path), timeout=150)[0]
    manifest = uc.read_manifest(uc.latest(tmp_path))
    norm = manifest.tensors["model/model.model.layers.0.input_layernorm.weight"]
    assert len(norm.pieces) == 1 and norm.pattern == {"placements": [["tp", "Replicate()"]]}
    assert len(manifest.tensors["model/model.model.embed_tokens.weight"].pieces) == 2  # vocabulary-parallel
    model = mp.llama(1)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    uc.load({"model": uc.model_parallel(model, optimizer)}, tmp_path)
    states = _states(model, optimizer)
    assert states.keys() == saved["states"].keys()
    for name, tensor in saved["states"].items():
        assert torch.equal(states[name], tensor), name
    # Sequence-sharded norms and the gathered LM head sum in another order than one process.
    torch.testing.assert_close(mp.train(model, optimizer, 3), saved["next"], rtol=1e-5, atol=1e-6)
