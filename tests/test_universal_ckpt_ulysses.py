"""Cross-package: sequence parallelism shards activations, not state, so a plait-ulysses-sp
run's checkpoint (Ulysses sp=2 x dp=2 under plait ZeRO-3, W=4) loads at another sp size (sp=1 x
dp=2, W=2) with every tensor bitwise, and training goes on along the sp=2 run's own continuation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("plait.zero_sharding")
pytest.importorskip("plait.ulysses_sp")

SEQ, LR = 18, 1e-2
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)


def _model(seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def ulysses_save_and_continue(root: str) -> dict:
    """Ulysses sp=2 x dp=2 + ZeRO-3: 3 steps, save, 3 more (the reference continuation)."""
    from plait.kernels.mesh import make_mesh
    from plait.ulysses_sp import dp_coordinates, shard_batch, sp_cross_entropy, sp_loss_value
    from plait.ulysses_sp.hf import apply_ulysses
    from plait.zero_sharding import ZeroConfig, zero_shard

    mesh = make_mesh(dp=2, sp=2)
    model = apply_ulysses(_model(0), mesh)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh, lr=LR)
    model.train()
    dp_rank, _ = dp_coordinates(mesh)
    curve = []
    for step in range(6):
        if step == 3:
            uc.save({"model": model}, root, step=3)
        local = shard_batch(_batch(step, dp_rank), mesh)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        share = sp_cross_entropy(logits, local["shift_labels"], mesh, scale=2)  # ZeRO averages over dp x sp
        share.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(sp_loss_value(share, mesh, scale=2))
    return {"dp_rank": dp_rank, "next": curve[3:]}


def load_sp1(root: str) -> dict:
    """sp=1 x dp=2 + ZeRO-3 (no Ulysses): load, re-save, train the same 3 batches per dp rank."""
    import torch.distributed as dist

    from plait.zero_sharding import ZeroConfig, zero_shard

    model, optimizer = zero_shard(_model(1), torch.optim.AdamW, ZeroConfig(stage=3), lr=LR)
    uc.load({"model": model}, root)
    resaved = uc.save({"model": model}, f"{root}-sp1", step=3)
    model.train()
    curve = []
    for step in range(3, 6):
        loss = model(**_batch(step, dist.get_rank())).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(loss.item())
    return {"next": curve, "resaved": str(resaved.path)}


def test_ulysses_sp2_checkpoint_loads_at_sp1(tmp_path):
    saved = run_distributed(ulysses_save_and_continue, 4, str(tmp_path / "sp2"), timeout=240)
    ckpt = uc.latest(tmp_path / "sp2")
    results = run_distributed(load_sp1, 2, str(tmp_path / "sp2"), timeout=180)

    before, resaved_dir = uc.read_manifest(ckpt), Path(results[0]["resaved"])
    after = uc.read_manifest(resaved_dir)
    compared = 0
    for name, entry in before.tensors.items():
        if entry.kind in ("parameter", "optimizer_state"):
            assert torch.equal(uc.read_full(ckpt, before, entry),
                               uc.read_full(resaved_dir, after, after.tensors[name])), name
            compared += 1
    assert compared > 0 and compared == sum(e.kind in ("parameter", "optimizer_state") for e in after.tensors.values())

    expected = {r["dp_rank"]: r["next"] for r in saved}
    for dp_rank, result in enumerate(results):
        # Same state and batches; Ulysses computes attention on re-laid-out heads and sums the loss
        # over sequence shards, so float32 sums round differently (a few 1e-7 relative per step).
        torch.testing.assert_close(result["next"], expected[dp_rank], rtol=1e-5, atol=1e-6)
