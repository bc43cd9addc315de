"""Ulysses' tiled loss from hidden states under ZeRO-3 (cross-package: plait-ulysses-sp +
plait-zero-sharding + transformers), written as the ulysses-sp README shows it:
``sp_tiled_cross_entropy(model.model(...).last_hidden_state, model.lm_head, shift_labels, mesh, chunks=...)``.

``model.model`` and ``model.lm_head`` are called outside the sharded model's forward, so ZeRO-3
must gather the embedding, final norm and head for them. At dp=1 x sp=2 the loss curve must follow
one process training on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("plait.ulysses_sp")
pytest.importorskip("plait.zero_sharding")

from plait.kernels.mesh import make_mesh  # noqa: E402
from plait.kernels.testing.distributed import run_distributed  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.ulysses_sp import shard_batch, sp_loss_value, sp_tiled_cross_entropy  # noqa: E402
from plait.ulysses_sp.hf import apply_ulysses  # noqa: E402
from plait.zero_sharding import ZeroConfig, zero_shard  # noqa: E402

CONFIG = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)
STEPS, SEQ, LR = 2, 16, 1e-2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _reference() -> list[float]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    curve = []
    for step in range(STEPS):
        loss = model(**_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(loss.item())
    return curve


def _tiled_under_zero3() -> list[float]:
    mesh = make_mesh(dp=1, sp=2)
    model = apply_ulysses(_model(), mesh)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh, lr=LR)
    sp = mesh["sp"].size()
    curve = []
    for step in range(STEPS):
        local = shard_batch(_batch(step), mesh)
        hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
        share = sp_tiled_cross_entropy(hidden, model.lm_head, local["shift_labels"], mesh, chunks=2, scale=sp)
        share.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(sp_loss_value(share, mesh, scale=sp))
    return curve


def test_tiled_loss_from_hidden_states_under_zero3_follows_one_process():
    want = torch.tensor(_reference())
    tol = tolerance("ulysses_model_grad", torch.float32)
    for rank, curve in enumerate(run_distributed(_tiled_under_zero3, 2, timeout=180)):
        tol.assert_close(torch.tensor(curve), want, what=f"ZeRO-3 x Ulysses tiled loss curve, rank {rank}")
