"""Padding and packed sequences under Ulysses, at sp 2 and 4 on gloo, against models without SP.

* Padding: HF Llama (sdpa inside) and Qwen3 (eager inside) called the way users call them, with
  ``attention_mask`` (each rank passes its slice) in a batch of a full row, a right-padded row
  and a left-padded row of other lengths. The reference is the same model on the whole batch
  with the same ``attention_mask`` (transformers' own masking). The shards hold different numbers
  of real tokens (checked), so a per-rank mean would be wrong: the loss divides by the group's
  count.
* Packed sequences: rows of several documents told apart only by ``position_ids`` restarting
  (one boundary on a shard edge, one row with trailing padding). The reference knows no masks:
  every document run alone through the model without SP, losses summed over all documents'
  tokens and divided once.
* Plain torch: ``DistributedAttention`` with packed ``position_ids`` against SDPA per document.
* A 4-D mask is refused with the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from plait.kernels.testing.distributed import run_distributed  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.ulysses_sp import (  # noqa: E402
    DistributedAttention,
    enable_offloaded_checkpointing,
    gather_sequence,
    shard_batch,
    shard_sequence,
    sp_cross_entropy,
    sp_group,
    sp_loss_value,
    sum_sp_gradients,
)
from plait.ulysses_sp.hf import apply_ulysses  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128)
SEQ = 22  # not a multiple of 4: shard_batch pads it at sp=4
# Packed rows: document lengths; row 1's 11 + 11 puts a boundary on the sp=2 shard edge, row 2 ends in padding.
DOCS = ((7, 5, 10), (11, 11), (6, 9))
PACKED_PAD = SEQ - sum(DOCS[2])


def _model(family: str):
    torch.manual_seed(0)
    config = (transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config)(**COMMON)
    config._attn_implementation = "sdpa" if family == "llama" else "eager"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _ids(rows: int) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (rows, SEQ), generator=torch.Generator().manual_seed(7))


def _padded_batch() -> dict[str, torch.Tensor]:
    ids = _ids(3)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding
    mask[2, :13] = 0  # left padding: at sp=4 rank 0 holds only padding of this row
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}


def _packed_batch() -> dict[str, torch.Tensor]:
    ids = _ids(len(DOCS))
    positions = torch.stack([torch.cat([torch.arange(n) for n in docs] + [torch.arange(SEQ - sum(docs))])
                             for docs in DOCS])
    mask = torch.ones_like(ids)
    mask[2, SEQ - PACKED_PAD:] = 0
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions, "attention_mask": mask}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _padded_reference(model) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' own masking on the whole batch; targets where input and target are both real tokens."""
    batch = _padded_batch()
    real = batch["attention_mask"].bool()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:].masked_fill(~(real[:, 1:] & real[:, :-1]), -100)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), _grads(model)


def _packed_reference(model) -> tuple[float, dict[str, torch.Tensor]]:
    """Each document alone through the model (no masks, no packing); one mean over all their targets."""
    ids, total, count = _packed_batch()["input_ids"], 0.0, 0
    for row, docs in enumerate(DOCS):
        start = 0
        for n in docs:
            doc = ids[row:row + 1, start:start + n]
            logits = model(input_ids=doc).logits
            total = total + F.cross_entropy(logits[0, :-1].float(), doc[0, 1:], reduction="sum")
            count, start = count + n - 1, start + n
    loss = total / count
    loss.backward()
    return loss.item(), _grads(model)


def _sp_step(model, batch) -> tuple[float, dict[str, torch.Tensor], int]:
    """What a user writes: the model called with this rank's attention_mask slice and position ids."""
    local = shard_batch(batch)
    logits = model(input_ids=local["input_ids"], attention_mask=local["attention_mask"],
                   position_ids=local["position_ids"]).logits
    share = sp_cross_entropy(logits, local["shift_labels"])
    share.backward()
    sum_sp_gradients(model)
    return sp_loss_value(share), _grads(model), int((local["shift_labels"] != -100).sum())


def _compare(what: str, loss: float, grads, ref_loss: float, ref_grads) -> None:
    tol = tolerance("ulysses_model_grad", torch.float32)
    tol.assert_close(torch.tensor(loss), torch.tensor(ref_loss), what=f"{what} loss")
    for name, grad in grads.items():
        tol.assert_close(grad, ref_grads[name], what=f"{what} grad {name}")


def _check_models(families: tuple[str, ...]) -> dict[str, list[int]]:
    """Every case of the module docstring's first two bullets; returns each case's valid targets per rank."""
    counts = {}
    for family in families:
        for kind, reference, batch in (("padded", _padded_reference, _padded_batch),
                                       ("packed", _packed_reference, _packed_batch)):
            base = _model(family)
            ref_loss, ref_grads = reference(copy.deepcopy(base))
            model = apply_ulysses(base)
            if kind == "packed" and family == "llama":  # the mask must survive the checkpoint's recompute
                enable_offloaded_checkpointing(model)
                model.train()
            loss, grads, valid = _sp_step(model, batch())
            _compare(f"{family} {kind} sp={sp_group(None).size}", loss, grads, ref_loss, ref_grads)
            counts[f"{family} {kind}"] = gather_sequence(torch.tensor([[valid]])).flatten().tolist()
    return counts


def test_padding_and_packing_sp2_equal_the_model_without_sp():
    counts = run_distributed(_check_models, 2, ("llama", "qwen3"), timeout=240)[0]
    assert len(counts) == 4
    assert counts["llama padded"][0] != counts["llama padded"][1]  # shards hold different token counts


def test_padding_and_packing_sp4_equal_the_model_without_sp():
    counts = run_distributed(_check_models, 4, ("llama",), timeout=240)[0]
    assert len(set(counts["llama padded"])) > 1 and len(counts["llama padded"]) == 4


def _attention_packed() -> float:
    """DistributedAttention(position_ids=...) against SDPA run on each document alone."""
    sp = sp_group(None)
    gen = torch.Generator().manual_seed(3)
    q, k, v, weight = (torch.randn(len(DOCS), 4, SEQ, 8, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    positions = _packed_batch()["position_ids"]
    outs = []
    for row, docs in enumerate(DOCS):
        parts = [F.scaled_dot_product_attention(*(t[row:row + 1, :, s:s + n] for t in (q, k, v)), is_causal=True)
                 for s, n in zip(torch.tensor((0, *docs[:-1])).cumsum(0).tolist(), docs, strict=True)]
        parts.append(torch.zeros(1, 4, SEQ - sum(docs), 8))  # trailing padding: weighted 0 below
        outs.append(torch.cat(parts, dim=2))
    real = (torch.arange(SEQ)[None, :] < torch.tensor([sum(d) for d in DOCS])[:, None])[:, None, :, None]
    (torch.cat(outs) * weight * real).sum().backward()
    refs = [t.grad.clone() for t in (q, k, v)]
    local = [shard_sequence(t.detach(), sp, dim=2).requires_grad_(True) for t in (q, k, v)]
    global_positions = shard_batch({"input_ids": torch.zeros(len(DOCS), SEQ, dtype=torch.long),
                                    "position_ids": positions})["position_ids"]
    out = DistributedAttention()(*local, is_causal=True, position_ids=gather_sequence(global_positions))
    real_local = shard_sequence(real, sp, dim=2)
    (out * shard_sequence(weight, sp, dim=2) * real_local).sum().backward()
    tol = tolerance("ulysses_attention", torch.float32)
    ref_out = torch.cat(outs).detach()
    tol.assert_close(out.detach() * real_local, shard_sequence(ref_out, sp, dim=2) * real_local, what="packed out")
    for name, got, want in zip("qkv", local, refs, strict=True):
        tol.assert_close(got.grad * real_local, shard_sequence(want, sp, dim=2) * real_local, what=f"packed d{name}")
    return float(out.detach().abs().sum())


def test_distributed_attention_packed_documents_equal_sdpa_per_document():
    sums = run_distributed(_attention_packed, 2, timeout=120)
    assert all(s > 0 for s in sums)


def _refuse_4d_mask() -> str:
    model = apply_ulysses(_model("llama"))
    local = shard_batch(_padded_batch())
    bad = torch.ones(3, 1, local["input_ids"].shape[1], local["input_ids"].shape[1])
    with pytest.raises(ValueError, match="2-D padding mask") as info:
        model(input_ids=local["input_ids"], attention_mask=bad, position_ids=local["position_ids"])
    return str(info.value)


def test_a_4d_mask_is_refused_with_the_fix():
    message = run_distributed(_refuse_4d_mask, 1, timeout=90)[0]  # refused before any exchange: one rank shows it
    assert "position_ids" in message
