"""ZeRO-Infinity with everything on disk (parameter shards, fp32 masters split into pieces,
AdamW state, gradient shards) on HF models nobody wrote for plait: a Llama with an untied head,
a GPT-2 with tied embeddings and a Qwen3, at two ranks; losses, parameters and optimizer state
bitwise those of in-memory ZeRO-3."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper beside this file

from zero_full_state import full_optimizer_state

from plait.kernels.testing import run_distributed, train_losses

transformers = pytest.importorskip("transformers")

BATCH, SEQ, STEPS = 4, 16, 3
OPT = dict(lr=3e-3, weight_decay=0.1, fused=True)  # the placement steps AdamW with the fused CPU kernel


def _model(name: str):
    common = dict(vocab_size=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False, **common))
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16, **common))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                                n_positions=64))


def infinity_hf_session(root: str, name: str) -> dict:
    from plait.offload_io import IOConfig, OffloadConfig, zero_placement
    from plait.offload_io.subgroups import MasterPiece
    from plait.zero_sharding import ZeroConfig, zero_shard

    def build(placement=None):
        torch.manual_seed(0)
        return zero_shard(_model(name), torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, **OPT)

    model, optimizer = build()
    ref = (train_losses(model, optimizer, STEPS, batch=BATCH, seq=SEQ),
           {k: v.clone() for k, v in model.state_dict().items()}, full_optimizer_state(model))
    io = IOConfig(block_size=65536, queue_depth=4, workers=2, fsync=False, min_free_bytes=0)
    path = os.path.join(root, f"{name}-rank{torch.distributed.get_rank()}")
    placement = zero_placement(OffloadConfig(device="nvme", param_device="nvme", grad_device="nvme", path=path,
                                             sub_group_size=2048, io=io))
    model, optimizer = build(placement)
    losses = train_losses(model, optimizer, STEPS, batch=BATCH, seq=SEQ)
    params = model.state_dict()
    state = full_optimizer_state(model)
    out = {"losses": losses == ref[0], "params": params.keys() == ref[1].keys() and all(
               torch.equal(params[k], ref[1][k]) for k in params),
           "state": state.keys() == ref[2].keys() and all(torch.equal(state[k], ref[2][k]) for k in state),
           "pieces": sum(isinstance(sg, MasterPiece) for sg in placement._subgroups)}
    placement.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen3"])
def test_zero_infinity_on_hf_models_is_bitwise(name: str, tmp_path) -> None:
    for rank, r in enumerate(run_distributed(infinity_hf_session, 2, str(tmp_path), name, timeout=240)):
        assert r["losses"] and r["params"] and r["state"], (name, rank, r)
        assert r["pieces"] >= 2, (name, rank, r)  # the embedding shard (8192 elements per rank) is split
