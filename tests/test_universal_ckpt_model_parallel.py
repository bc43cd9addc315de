"""Cross-package: a checkpoint of plait ZeRO-3 (plait-zero-sharding) loads into torch tensor
parallelism (plait-universal-ckpt's model_parallel over ``parallelize_module``), because both
name state in the same consolidated form (``model.<p>``, ``optim.<field>.<p>``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("plait.zero_sharding")

OPT = dict(lr=1e-2, weight_decay=0.1)


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                         attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def _batch() -> torch.Tensor:
    return torch.arange(20).reshape(2, 10) * 5 % 64


def _train(model, optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(_batch(), labels=_batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def zero3_then_continue(root: str) -> list[float]:
    """Plait ZeRO-3 at W=2 (each rank the same batch): 3 steps, save, 3 more (the reference)."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    model, optimizer = zero_shard(_llama(0), torch.optim.AdamW, ZeroConfig(stage=3), **OPT)
    _train(model, optimizer, 3)
    uc.save({"model": model}, root, step=3)
    return _train(model, optimizer, 3)


def torch_tp_resume(root: str) -> list[float]:
    """torch TP=2: load the ZeRO-3 checkpoint (weights, moments, steps) and train 3 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = _llama(1)
    plan = {}
    for index in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{index}.{name}"] = ColwiseParallel()
        plan[f"model.layers.{index}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{index}.mlp.down_proj"] = RowwiseParallel()
    model = parallelize_module(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    config = uc.ModelParallelConfig(groups={"tp": tuple(range(dist.get_world_size()))})
    uc.load({"model": uc.model_parallel(model, optimizer, config=config)}, root)
    return _train(model, optimizer, 3)


def test_zero3_checkpoint_resumes_under_torch_tp(tmp_path):
    expected = run_distributed(zero3_then_continue, 2, str(tmp_path), timeout=150)[0]
    resumed = run_distributed(torch_tp_resume, 2, str(tmp_path), timeout=150)[0]
    # Same state and data; ZeRO's reduce-scatter and TP's row-parallel sums order additions
    # differently, so the losses agree to float32 rounding accumulated over 3 steps.
    torch.testing.assert_close(resumed, expected, rtol=1e-5, atol=1e-6)
