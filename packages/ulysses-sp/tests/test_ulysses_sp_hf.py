"""HF Llama and Qwen3 (tiny, random, built offline) with Ulysses at sp 2 and 4 on gloo: the loss and
every parameter gradient equal the same model without SP on the whole sequence; with padding,
odd lengths, GQA (kv heads < sp) and tiled MLP + tiled loss + offloaded checkpoints; apply is reversible; models whose
attention cannot be wrapped are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.kernels.mesh import make_mesh  # noqa: E402
from plait.kernels.testing.distributed import run_distributed  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.ulysses_sp import (  # noqa: E402
    UlyssesConfig,
    enable_offloaded_checkpointing,
    shard_batch,
    sp_cross_entropy,
    sp_loss_value,
    sp_tiled_cross_entropy,
    sum_sp_gradients,
)
from plait.ulysses_sp.hf import (  # noqa: E402
    ATTN_NAME,
    UnsupportedModelError,
    apply_ulysses,
    is_ulysses,
    remove_ulysses,
)

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128)


def _model(family: str):
    """Llama runs sdpa inside Ulysses, Qwen3 eager (whose causal mask Ulysses must build itself)."""
    torch.manual_seed(0)
    config = (transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config)(**COMMON)
    config._attn_implementation = "sdpa" if family == "llama" else "eager"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _batch(seq: int, padded: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, COMMON["vocab_size"], (2, seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, seq - 4:] = 0  # sample 1 right-padded
        batch["attention_mask"] = mask
    return batch


def _reference(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    labels = batch["labels"].masked_fill(batch.get("attention_mask", torch.ones_like(batch["labels"])) == 0, -100)
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sp_step(model, batch, tiled: bool) -> tuple[float, dict[str, torch.Tensor]]:
    local = shard_batch(batch)
    extra = {"key_padding_mask": local["key_padding_mask"]} if "key_padding_mask" in local else {}
    if tiled:
        out = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"], **extra)
        hidden = out.last_hidden_state
        share = sp_tiled_cross_entropy(hidden, model.lm_head, local["shift_labels"], chunks=3)
    else:
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], **extra).logits
        share = sp_cross_entropy(logits, local["shift_labels"])
    share.backward()
    sum_sp_gradients(model)
    return sp_loss_value(share), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_families(families: tuple[str, ...], fpdt: bool = False) -> list[str]:
    """Plain Ulysses and the whole ALST set; with ``fpdt``, ALST twice with FPDT's attention inside
    (5-token chunks: several blocks, uneven)."""
    tol = tolerance("ulysses_model_grad", torch.float32)
    inner = {"inner_attention": "fpdt", "fpdt_chunk": 5} if fpdt else {}
    checked = []
    for family in families:
        for seq, padded, tiled in ((24, False, fpdt), (21, True, True)):
            base = _model(family)
            ref_loss, ref_grads = _reference(copy.deepcopy(base), _batch(seq, padded))
            model = apply_ulysses(base, config=UlyssesConfig(tiled_mlp_chunks=3 if tiled else None, **inner))
            if tiled:  # the whole ALST set: checkpointed layers with their inputs kept on the host
                assert enable_offloaded_checkpointing(model) == COMMON["num_hidden_layers"]
                model.train()  # transformers checkpoints only in training mode (dropout is 0 here)
            loss, grads = _sp_step(model, _batch(seq, padded), tiled)
            what = f"{family} seq={seq} padded={padded} tiled={tiled} fpdt={fpdt}"
            tol.assert_close(torch.tensor(loss), torch.tensor(ref_loss), what=f"{what} loss")
            for name, grad in grads.items():
                tol.assert_close(grad, ref_grads[name], what=f"{what} grad {name}")
            checked.append(what)
    return checked


def test_hf_llama_and_qwen3_sp2_loss_and_grads_equal_single_process():
    results = run_distributed(_check_families, 2, ("llama", "qwen3"), timeout=180)
    assert len(results[0]) == 4


def test_hf_llama_sp4_kv_heads_fewer_than_sp_equal_single_process():
    results = run_distributed(_check_families, 4, ("llama",), timeout=180)
    assert len(results[0]) == 2


def test_hf_llama_and_qwen3_sp2_fpdt_inside_equal_single_process():
    results = run_distributed(_check_families, 2, ("llama", "qwen3"), True, timeout=180)
    assert len(results[0]) == 4


def _apply_and_remove() -> tuple[str, str, bool]:
    model = _model("llama")
    apply_ulysses(model, config=UlyssesConfig(tiled_mlp_chunks=2))
    apply_ulysses(model, config=UlyssesConfig(tiled_mlp_chunks=2))  # idempotent
    during = model.config._attn_implementation
    remove_ulysses(model)
    tiled_left = any("forward" in vars(m) for m in model.modules() if type(m).__name__.endswith("MLP"))
    return during, model.config._attn_implementation, is_ulysses(model) or tiled_left


def test_apply_is_idempotent_and_reversible():
    during, after, leftover = run_distributed(_apply_and_remove, 1, timeout=60)[0]
    assert during == ATTN_NAME and after == "sdpa" and not leftover  # llama: sdpa before and after


def _refusals() -> list[str]:
    messages = []
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel|inner") as info:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
        model.config._attn_implementation = "flash_attention_2"
        apply_ulysses(model)
    messages.append(str(info.value))
    with pytest.raises(UnsupportedModelError, match="Linear"):
        apply_ulysses(torch.nn.Linear(2, 2))  # not an HF model at all
    with pytest.raises(ValueError, match="smaller than sp"):
        apply_ulysses(transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**{**COMMON, "num_attention_heads": 1, "num_key_value_heads": 1,
                                        "head_dim": 64})))
    with pytest.raises(ValueError, match="world size 2 is not divisible by 3"):
        make_mesh(dp=-1, sp=3)  # sp must divide the world size
    with pytest.raises(ValueError, match="shorter than sp"):
        shard_batch({"input_ids": torch.zeros(1, 1, dtype=torch.long)})
    return messages


def test_bad_input_is_refused_with_the_reason():
    messages = run_distributed(_refusals, 2, timeout=60)[0]
    assert "flash_attention_2" in messages[0] or "AttentionInterface" in messages[0]


def _without_position_ids() -> float:
    """The model called with input_ids only: the pre-hook must give each rank its true (global) positions,
    or RoPE would rotate every slice as if it started at 0."""
    tol = tolerance("ulysses_model_grad", torch.float32)
    base = _model("llama")
    batch = _batch(24, padded=False)
    ref_loss, ref_grads = _reference(copy.deepcopy(base), batch)
    model = apply_ulysses(base)
    local = shard_batch(batch)
    share = sp_cross_entropy(model(input_ids=local["input_ids"]).logits, local["shift_labels"])
    share.backward()
    sum_sp_gradients(model)
    loss = sp_loss_value(share)
    tol.assert_close(torch.tensor(loss), torch.tensor(ref_loss), what="loss without position_ids")
    for name, grad in {n: p.grad for n, p in model.named_parameters()}.items():
        tol.assert_close(grad, ref_grads[name], what=f"grad {name} without position_ids")
    return loss


def test_true_positions_without_position_ids():
    losses = run_distributed(_without_position_ids, 2, timeout=120)
    assert losses[0] == losses[1]
