"""Ulysses in bf16 (bf16 weights, and fp32 weights under CPU bf16 autocast) on gloo, against the same
precision without SP and against fp32.

Two claims per case, on a padded batch (so masks are built in bf16 too):

* elementwise, every parameter gradient and the loss equal the single-process bf16 run within a
  few bf16 ulps of the tensor's scale (``tolerance("ulysses_model_grad", torch.bfloat16)``, whose
  reason says where the two runs round differently);
* SP adds less error than bf16 itself: the gradients' distance (L2 over all parameters) from
  the single-process bf16 run is smaller than that run's own distance from fp32.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from plait.kernels.testing.distributed import run_distributed  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.ulysses_sp import shard_batch, sp_cross_entropy, sp_loss_value, sum_sp_gradients  # noqa: E402
from plait.ulysses_sp.hf import apply_ulysses  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128)


def _model(family: str):
    torch.manual_seed(0)
    config = (transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config)(**COMMON)
    config._attn_implementation = "sdpa" if family == "llama" else "eager"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, COMMON["vocab_size"], (3, 22), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, :13] = 0
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}


def _reference(model, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    batch = _batch()
    real = batch["attention_mask"].bool()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:].masked_fill(~(real[:, 1:] & real[:, :-1]), -100)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), _grads(model)


def _sp(model, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    local = shard_batch(_batch())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=local["input_ids"], attention_mask=local["attention_mask"],
                       position_ids=local["position_ids"]).logits
    share = sp_cross_entropy(logits, local["shift_labels"])
    share.backward()
    sum_sp_gradients(model)
    return sp_loss_value(share), _grads(model)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([(a[n] - b[n]).flatten() for n in a]).norm())


def _check(families: tuple[str, ...], modes: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Returns, per case, (SP's distance from bf16 single-process, bf16's distance from fp32)."""
    tol = tolerance("ulysses_model_grad", torch.bfloat16)
    distances = {}
    for family in families:
        for mode in modes:
            base = _model(family)
            _, fp32_grads = _reference(copy.deepcopy(base), autocast=False)
            low = copy.deepcopy(base).to(torch.bfloat16) if mode == "bf16" else copy.deepcopy(base)
            ref_loss, ref_grads = _reference(copy.deepcopy(low), autocast=mode == "autocast")
            loss, grads = _sp(apply_ulysses(low), autocast=mode == "autocast")
            what = f"{family} {mode}"
            tol.assert_close(torch.tensor(loss / ref_loss), torch.tensor(1.0), what=f"{what} loss / reference")
            for name, grad in grads.items():
                scale = ref_grads[name].abs().max().clamp_min(1e-30)
                tol.assert_close(grad / scale, ref_grads[name] / scale, what=f"{what} grad {name} / its max")
            distances[what] = (_distance(grads, ref_grads), _distance(ref_grads, fp32_grads))
    return distances


def _assert_sp_adds_less_than_bf16(distances: dict[str, tuple[float, float]]) -> None:
    for what, (sp_error, bf16_error) in distances.items():
        assert bf16_error > 0 and sp_error < bf16_error, (what, sp_error, bf16_error)


def test_bf16_and_autocast_sp2_match_single_process_bf16():
    distances = run_distributed(_check, 2, ("llama", "qwen3"), ("bf16", "autocast"), timeout=240)[0]
    assert len(distances) == 4
    _assert_sp_adds_less_than_bf16(distances)


def test_bf16_sp4_matches_single_process_bf16():
    distances = run_distributed(_check, 4, ("llama",), ("bf16",), timeout=240)[0]
    _assert_sp_adds_less_than_bf16(distances)
