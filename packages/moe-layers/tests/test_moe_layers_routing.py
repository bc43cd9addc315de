"""MoE layer on one process against a plain dense reference written token by token: routing (both
score orders, renormalisation, noise), capacity with both drop policies and dropless, the aux
loss and z-loss against their formulas, user expert modules, Residual MoE, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.tolerances import tolerance
from plait.moe_layers import MoE, MoEConfig, collect_losses

H, I, E = 8, 6, 4


def _config(**overrides) -> MoEConfig:
    return MoEConfig(**{"hidden_size": H, "num_experts": E, "intermediate_size": I, **overrides})


def _expert(layer: MoE, e: int, row: torch.Tensor) -> torch.Tensor:
    w_gu, w_d = layer.experts.gate_up_proj[e].double(), layer.experts.down_proj[e].double()
    return w_d @ (F.silu(w_gu[:I] @ row) * (w_gu[I:] @ row))


def dense_reference(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, one token at a time, no sorting: returns (output, kept [T, k])."""
    cfg = layer.config
    flat = x.reshape(-1, H).double()
    logits = flat @ layer.router.weight.double().t()
    probs = logits.softmax(-1)
    tokens = flat.shape[0]
    choices = []  # (token, slot, expert, weight, priority)
    for t in range(tokens):
        ids = logits[t].topk(cfg.top_k).indices
        if cfg.score_order == "topk_softmax":
            weights = logits[t, ids].softmax(-1)
        else:
            weights = probs[t, ids] / (probs[t, ids].sum() if cfg.renormalize else 1.0)
        choices += [(t, s, int(ids[s]), weights[s], float(probs[t, ids[s]].detach())) for s in range(cfg.top_k)]
    capacity = cfg.capacity(tokens, training=layer.training)
    if cfg.drop_policy == "position":
        ranked = sorted(choices, key=lambda c: (c[1], c[0]))
    elif cfg.drop_policy == "token":
        ranked = sorted(choices, key=lambda c: (c[0], c[1]))
    else:
        ranked = sorted(choices, key=lambda c: -c[4])
    taken = [0] * E
    kept = torch.zeros(tokens, cfg.top_k, dtype=torch.bool)
    for t, s, e, _, _ in ranked:
        if capacity is None or taken[e] < capacity:
            taken[e] += 1
            kept[t, s] = True
    out = torch.zeros(tokens, H, dtype=torch.float64)
    for t, s, e, w, _ in choices:
        if kept[t, s]:
            out[t] += w * _expert(layer, e, flat[t])
    return out.view(x.shape), kept


CASES = {
    "dropless_top2": {},
    "top1_switch": {"top_k": 1, "renormalize": False},
    "top2_capacity_position": {"capacity_factor": 0.75, "min_capacity": 1},
    "top2_capacity_probability": {"capacity_factor": 0.75, "min_capacity": 1, "drop_policy": "probability"},
    "top2_capacity_token": {"capacity_factor": 0.75, "min_capacity": 1, "drop_policy": "token"},
    "top1_capacity_probability": {"top_k": 1, "capacity_factor": 1.0, "min_capacity": 0, "drop_policy": "probability"},
    "topk_softmax": {"score_order": "topk_softmax", "top_k": 3},
    "no_renormalize": {"renormalize": False},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_equals_dense_reference(case: str) -> None:
    torch.manual_seed(0)
    layer = MoE(_config(**CASES[case]))
    x = torch.randn(3, 7, H)
    out, losses = layer(x, return_losses=True)
    expected, kept = dense_reference(layer, x)
    tol = tolerance("moe_grouped_fwd", torch.float32)
    torch.testing.assert_close(out.double(), expected, atol=tol.atol, rtol=tol.rtol)
    assert losses.dropped == int((~kept).sum())
    assert int(losses.expert_load.sum()) == int(kept.sum())
    if "capacity" in case:
        assert losses.dropped > 0, "the capacity cases must actually drop"


def test_gradients_equal_dense_reference() -> None:
    torch.manual_seed(1)
    layer = MoE(_config(capacity_factor=1.0, min_capacity=1)).double()
    x = torch.randn(10, H, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(10, H, dtype=torch.float64)
    grads = torch.autograd.grad((layer(x) * probe).sum(), [x, *layer.parameters()])
    reference, kept = dense_reference(layer, x)
    assert not kept.all(), "capacity 1.0 on 10 tokens must drop some choices: the dropped path's gradient is tested"
    ref_grads = torch.autograd.grad((reference * probe).sum(), [x, *layer.parameters()])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_aux_losses_equal_formulas() -> None:
    torch.manual_seed(2)
    layer = MoE(_config(top_k=2))
    x = torch.randn(16, H)
    _, losses = layer(x, return_losses=True)
    logits = x.double() @ layer.router.weight.double().t()
    probs = logits.softmax(-1)
    chosen = logits.topk(2).indices
    fraction = torch.stack([(chosen == e).sum() for e in range(E)]).double() / chosen.numel()
    torch.testing.assert_close(losses.load_balancing.double(), E * (fraction * probs.mean(0)).sum())
    torch.testing.assert_close(losses.z_loss.double(), (torch.logsumexp(logits, -1) ** 2).mean())
    # Equal router probabilities give exactly 1 whatever the choices (the loss's floor at any top_k).
    with torch.no_grad():
        layer.router.weight.zero_()
    x_balanced = torch.eye(E, H).repeat(2, 1)
    _, uniform = layer(x_balanced, return_losses=True)
    assert math.isclose(float(uniform.load_balancing.detach()), 1.0, rel_tol=1e-6)
    assert math.isclose(float(uniform.z_loss.detach()), math.log(E) ** 2, rel_tol=1e-6)
    other = MoE(layer.config)
    _, other_losses = other(x, return_losses=True)
    balance, z_loss = collect_losses(nn.Sequential(layer, other))
    assert torch.equal(balance, uniform.load_balancing + other_losses.load_balancing)
    assert torch.equal(z_loss, uniform.z_loss + other_losses.z_loss)


def test_jitter_noise_equals_formula_and_only_in_training() -> None:
    torch.manual_seed(3)
    layer = MoE(_config(noise="jitter", noise_eps=0.5))
    x = torch.randn(12, H)
    torch.manual_seed(7)
    noisy = layer(x)
    torch.manual_seed(7)
    scale = torch.empty_like(x).uniform_(0.5, 1.5)
    # The jitter scales the router's input only; the experts see the clean tokens.
    layer.router.eval()  # the same routing without drawing noise a second time
    routed = layer.router(x * scale)
    layer.router.train()
    clean_expert_input = MoE(layer.config)
    clean_expert_input.load_state_dict(layer.state_dict())
    clean_expert_input.router.forward = lambda _x: routed
    torch.testing.assert_close(noisy, clean_expert_input(x))
    layer.eval()
    torch.testing.assert_close(layer(x), dense_reference(layer, x)[0].float(), atol=1e-5, rtol=1e-4)


def test_gumbel_noise_changes_selection_not_weights() -> None:
    torch.manual_seed(4)
    layer = MoE(_config(noise="gumbel", noise_eps=5.0, top_k=1, renormalize=False))
    x = torch.randn(64, H)
    routing = layer.router(x)
    clean_ids = routing.logits.topk(1).indices
    assert (routing.expert_ids != clean_ids).any(), "large Gumbel noise must change some choices"
    torch.testing.assert_close(routing.weights, routing.probs.gather(1, routing.expert_ids))
    layer.eval()
    assert torch.equal(layer.router(x).expert_ids, clean_ids)


def test_eval_capacity_factor() -> None:
    cfg = _config(capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0)
    assert cfg.capacity(8, training=True) == 4 and cfg.capacity(8, training=False) == 8
    assert _config().capacity(8, training=True) is None


def test_user_expert_modules_and_residual() -> None:
    torch.manual_seed(5)
    experts = [nn.Sequential(nn.Linear(H, 5), nn.Tanh(), nn.Linear(5, H)) for _ in range(E)]
    layer = MoE(_config(top_k=2, residual=True), experts=experts)
    x = torch.randn(9, H)
    out = layer(x)
    logits = x @ layer.router.weight.t()
    probs = logits.softmax(-1)
    weights, ids = probs.topk(2)
    weights = weights / weights.sum(-1, keepdim=True)
    moe = torch.stack([sum(weights[t, s] * experts[ids[t, s]](x[t]) for s in range(2)) for t in range(9)])
    mix = layer.coefficient(x).softmax(-1)
    expected = moe * mix[:, :1] + layer.dense(x) * mix[:, 1:]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    out.sum().backward()
    assert all(p.grad is not None for p in layer.parameters())


@pytest.mark.parametrize(("field", "value", "match"), [
    ("capacity_factor", 0.0, "capacity_factor=0.0 must be a positive number"),
    ("capacity_factor", -1.0, "capacity_factor=-1.0"),
    ("top_k", 5, "top_k=5 exceeds num_experts=4"),
    ("top_k", 0, "top_k=0 must be a positive int"),
    ("num_experts", 0, "num_experts=0"),
    ("drop_policy", "lottery", "drop_policy='lottery' is not supported"),
    ("noise", "rsample", "noise='rsample'"),
    ("noise_eps", -0.1, "noise_eps=-0.1"),
    ("min_capacity", -1, "min_capacity=-1"),
    ("router_gradient", "sparsemixer", "router_gradient='sparsemixer' is not supported"),
    ("grin_eps", -0.5, "grin_eps=-0.5 must be a finite number"),
])
def test_bad_config_refused(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**{field: value})


def test_bad_input_refused() -> None:
    with pytest.raises(ValueError, match="got 3 expert modules"):
        MoE(_config(), experts=[nn.Identity()] * 3)
    with pytest.raises(ValueError, match="last dimension 5"):
        MoE(_config())(torch.randn(2, 5))
    with pytest.raises(ValueError, match="no plait MoE layer"):
        collect_losses(nn.Linear(2, 2))
