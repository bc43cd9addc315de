"""HF conversion on real transformers architectures (tiny random configs, built offline): Mixtral,
Qwen2-MoE (shared expert), Qwen3-MoE and PhiMoE (GRIN routing; its training-mode router gradient
is checked against HF's own SparseMixer-v2 in test_moe_layers_grin.py). Logits and greedy
generation equal the unconverted model, training gradients equal HF's, the aux loss ties to HF's
own load_balancing_loss_func, and restore puts the HF blocks back."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.moe_layers import MoE, moe_layers  # noqa: E402
from plait.moe_layers.hf import SharedExpertMoE, convert_hf_moe, restore_hf_moe  # noqa: E402

COMMON = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=96,
              num_hidden_layers=2, vocab_size=128)


def _build(family: str):
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                             shared_expert_intermediate_size=96, norm_topk_prob=False)
    elif family == "phimoe":
        config = transformers.PhimoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    else:  # layer 1 dense (mlp_only_layers): only one block converts
        config = transformers.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                             mlp_only_layers=[1], norm_topk_prob=True)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize(("family", "blocks"), [("mixtral", 2), ("qwen2_moe", 2), ("qwen3_moe", 1),
                                                 ("phimoe", 2)])
def test_converted_logits_generation_and_restore(family: str, blocks: int) -> None:
    model = _build(family)
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
    tokens_before = _generate(model, ids)
    assert convert_hf_moe(model) == blocks
    assert convert_hf_moe(model) == 0  # idempotent
    assert len(moe_layers(model)) == blocks
    if family == "qwen2_moe":
        assert all(isinstance(layer.mlp, SharedExpertMoE) for layer in model.model.layers)
    if family == "phimoe":
        assert all(m.config.router_gradient == "grin" and m.config.grin_eps == 0.01 for m in moe_layers(model))
    assert not any(m.training for m in moe_layers(model))  # converted in the model's (eval) mode
    with torch.no_grad():
        after = model(ids).logits
    tol = tolerance("moe_expert_parallel", torch.float32)
    torch.testing.assert_close(after, before, atol=tol.atol, rtol=tol.rtol)
    assert torch.equal(_generate(model, ids), tokens_before)
    assert restore_hf_moe(model) == blocks
    assert not moe_layers(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_converted_training_gradients_equal_hf() -> None:
    reference, model = _build("mixtral").train(), _build("mixtral").train()
    convert_hf_moe(model)
    ids = _ids()
    reference(ids, labels=ids).loss.backward()
    model(ids, labels=ids).loss.backward()
    tol = tolerance("moe_expert_parallel", torch.float32)
    ref_params = dict(reference.named_parameters())
    plait_grads = {id(p): p.grad for p in model.parameters()}
    restore_hf_moe(model)  # HF names again, same Parameter objects
    for name, param in model.named_parameters():
        torch.testing.assert_close(plait_grads[id(param)], ref_params[name].grad, atol=tol.atol, rtol=tol.rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_aux_loss_ties_to_hf_load_balancing() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = _build("mixtral")
    ids = _ids()
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits
    convert_hf_moe(model)
    with torch.no_grad():
        model(ids)
    for layer, logits in zip(moe_layers(model), router_logits):
        hf_value = load_balancing_loss_func((logits,), num_experts=4, top_k=2)
        # HF's value is top_k times plait's (plait normalises the assignment fractions by T * k).
        torch.testing.assert_close(layer.last_losses.load_balancing * 2, hf_value.float())


def test_overrides_and_bad_input() -> None:
    model = _build("mixtral")
    convert_hf_moe(model, capacity_factor=1.0, min_capacity=1)
    assert all(isinstance(m, MoE) and m.config.capacity_factor == 1.0 for m in moe_layers(model))
    with pytest.raises(ValueError, match="not MoEConfig fields"):
        convert_hf_moe(_build("mixtral"), capacity=2)
    with pytest.raises(ValueError, match="found no MixtralSparseMoeBlock"):
        convert_hf_moe(torch.nn.Linear(2, 2))
