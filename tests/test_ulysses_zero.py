"""Ulysses composed with ZeRO (cross-package: plait-ulysses-sp + plait-zero-sharding + transformers,
and plait-offload-io for the offload case).

ZeRO shards over ``dp x sp`` (zero-sharding's default ``shard_dims``) and averages gradients over
those 4 ranks; Ulysses ranks therefore scale their loss share by ``sp`` (the loss contract in the
ulysses-sp README, "With ZeRO"). The reference is DDP's arithmetic in one process: the mean of the two
dp batches' losses, one AdamW step on the mean gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("plait.zero_sharding")

from plait.kernels.mesh import make_mesh  # noqa: E402
from plait.kernels.testing.distributed import run_distributed  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.ulysses_sp import (  # noqa: E402
    UlyssesConfig,
    dp_coordinates,
    enable_offloaded_checkpointing,
    shard_batch,
    sp_cross_entropy,
    sp_loss_value,
)
from plait.ulysses_sp.hf import apply_ulysses  # noqa: E402
from plait.ulysses_sp.zero_extension import SequenceParallelExtension  # noqa: E402
from plait.zero_sharding import ZeroConfig, zero_shard  # noqa: E402

STEPS, SEQ, LR = 3, 18, 1e-2
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)


def _model(family: str = "llama"):
    torch.manual_seed(0)
    config = (transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig)(**CONFIG)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _ddp_reference(model, dp: int) -> list[list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    curve = []
    for step in range(STEPS):
        losses = [model(**_batch(step, r)).loss for r in range(dp)]
        (sum(losses) / dp).backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append([loss.item() for loss in losses])
    return curve


def _placement(offload: bool):
    if not offload:
        return None
    from plait.offload_io import OffloadConfig, zero_placement

    return zero_placement(OffloadConfig(device="cpu"))


def _ulysses_zero(stage: int, tiled: bool, offload: bool,
                  family: str = "llama") -> tuple[list[list[float]], list[float], int]:
    mesh = make_mesh(dp=2, sp=2)
    base = _model(family)
    reference = _ddp_reference(copy.deepcopy(base), dp=2)
    model = apply_ulysses(base, mesh, config=UlyssesConfig(tiled_mlp_chunks=3 if tiled else None))
    if tiled:  # ALST's checkpoint offload under ZeRO: the recompute must regather stage-3 parameters
        enable_offloaded_checkpointing(model)
    model.train()
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage), mesh=mesh,
                                  placement=_placement(offload), lr=LR)
    with pytest.raises(ValueError, match="apply_ulysses must come first"):
        apply_ulysses(model, mesh)
    with pytest.raises(ValueError, match="apply_ulysses must come first"):  # the integrations' sp_size extension
        SequenceParallelExtension(mesh).apply(model, mesh)
    dp_rank, _ = dp_coordinates(mesh)
    sp = mesh["sp"].size()
    curve = []
    for step in range(STEPS):
        local = shard_batch(_batch(step, dp_rank), mesh)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        share = sp_cross_entropy(logits, local["shift_labels"], mesh, scale=sp)
        share.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(sp_loss_value(share, mesh, scale=sp))
    return reference, curve, dp_rank


@pytest.mark.parametrize(("stage", "tiled", "offload", "family"), [
    (3, True, False, "llama"), (2, False, False, "llama"), (3, False, True, "llama"), (1, False, False, "llama"),
    (3, False, False, "qwen3"),
])
def test_ulysses_with_zero_over_dp2_sp2_follows_the_ddp_loss_curve(stage, tiled, offload, family):
    if offload:
        pytest.importorskip("plait.offload_io")
    results = run_distributed(_ulysses_zero, 4, stage, tiled, offload, family, timeout=240)
    tol = tolerance("ulysses_model_grad", torch.float32)
    for reference, curve, dp_rank in results:
        got = torch.tensor(curve)
        want = torch.tensor([r[dp_rank] for r in reference])
        what = f"{family} ZeRO-{stage} (offload={offload}) x Ulysses loss curve, dp rank {dp_rank}"
        tol.assert_close(got, want, what=what)
