"""GRIN's router (SparseMixer-v2): the choice, the weights and the router gradient against the
estimator written plainly, the sampling distribution, and HF PhiMoE's own implementation."""

from __future__ import annotations

import pytest
import torch

from plait.moe_layers import MoE, MoEConfig
from plait.moe_layers.grin import MIDPOINT_SCALE, sparse_mixer_v2

E, K, EPS = 8, 2, 0.3


def _logits(tokens: int = 48, seed: int = 0) -> torch.Tensor:
    # Spread so that a few experts are eligible per draw (a gap under 2 * EPS of the best).
    return torch.randn(tokens, E, generator=torch.Generator().manual_seed(seed)) * 2.0


def _plain_estimator(logits: torch.Tensor, expert_ids: torch.Tensor, upstream: torch.Tensor, eps: float):
    """Per token and draw, loops only: eligible set, restricted softmax pi, and the logits' gradient
    sum_j g_j * pi_j[e_j] * (onehot(e_j) - pi_j). Returns (pis [T, k, E], grad [T, E])."""
    tokens, experts = logits.shape
    pis = torch.zeros(tokens, expert_ids.shape[1], experts, dtype=torch.float64)
    grad = torch.zeros(tokens, experts, dtype=torch.float64)
    for t in range(tokens):
        z = logits[t].double()
        drawn: list[int] = []
        for j, e in enumerate(expert_ids[t].tolist()):
            best = max(z[i].item() for i in range(experts) if i not in drawn)
            ok = [i for i in range(experts) if i not in drawn
                  and (best - z[i].item()) / max(abs(z[i].item()), best) <= 2 * eps]
            assert e in ok, "the draw picked an expert that was not eligible"
            denominator = sum(torch.exp(z[i]).item() for i in ok)
            for i in ok:
                pis[t, j, i] = torch.exp(z[i]).item() / denominator
            onehot = torch.zeros(experts, dtype=torch.float64)
            onehot[e] = 1.0
            grad[t] += upstream[t, j].double() * pis[t, j, e] * (onehot - pis[t, j])
            drawn.append(e)
    return pis, grad


def test_training_draws_weights_and_gradient_equal_the_plain_estimator() -> None:
    logits = _logits().requires_grad_()
    torch.manual_seed(3)
    expert_ids, weights = sparse_mixer_v2(logits, K, EPS, training=True)
    upstream = torch.randn(weights.shape, generator=torch.Generator().manual_seed(4))
    (weights * upstream).sum().backward()
    pis, grad = _plain_estimator(logits.detach(), expert_ids, upstream, EPS)
    assert all(len(set(row)) == K for row in expert_ids.tolist())  # k distinct experts per token
    chosen = pis.gather(-1, expert_ids.unsqueeze(-1)).squeeze(-1)
    factor = weights.detach().double() / chosen
    likeliest = expert_ids == pis.argmax(dim=-1)
    # The midpoint factor is 1 for the likeliest eligible draw, else 1 or 1/3.
    assert torch.allclose(factor[likeliest], torch.ones(()).double(), atol=1e-6)
    thirds = torch.isclose(factor, torch.tensor(MIDPOINT_SCALE).double(), atol=1e-6)
    assert bool((thirds | torch.isclose(factor, torch.ones(()).double(), atol=1e-6)).all())
    assert int(thirds.sum()) > 0 and int((~likeliest).sum()) > int(thirds.sum())  # both outcomes occur
    torch.testing.assert_close(logits.grad.double(), grad, atol=1e-6, rtol=1e-5)


def test_eval_takes_the_argmax_of_each_draw_without_the_factor() -> None:
    logits = _logits(seed=1).requires_grad_()
    expert_ids, weights = sparse_mixer_v2(logits, K, EPS, training=False)
    again, _ = sparse_mixer_v2(logits, K, EPS, training=False)
    assert torch.equal(expert_ids, again)
    assert torch.equal(expert_ids, logits.detach().topk(K, dim=-1).indices)  # best remaining = top-k order
    upstream = torch.ones_like(weights)
    weights.sum().backward()
    pis, grad = _plain_estimator(logits.detach(), expert_ids, upstream, EPS)
    torch.testing.assert_close(weights.detach().double(), pis.gather(-1, expert_ids.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(logits.grad.double(), grad, atol=1e-6, rtol=1e-5)


def test_draws_follow_the_restricted_softmax_and_the_midpoint_coin() -> None:
    row = torch.tensor([2.0, 1.9, 1.7, 1.5, 0.2, -1.0, -3.0, 0.0])
    tokens = 40_000
    logits = row.expand(tokens, E).contiguous()
    torch.manual_seed(7)
    expert_ids, weights = sparse_mixer_v2(logits, 1, EPS, training=True)
    eligible = (row.max() - row) / row.abs().clamp(min=row.max()) <= 2 * EPS
    pi = torch.where(eligible, row, torch.tensor(float("-inf"))).softmax(-1)
    counts = torch.bincount(expert_ids[:, 0], minlength=E).double()
    sigma = (tokens * pi.double() * (1 - pi.double())).sqrt()
    assert bool(((counts - tokens * pi.double()).abs() <= 5 * sigma + 1e-9).all())
    assert int(counts[~eligible].sum()) == 0
    others = expert_ids[:, 0] != 0
    kept = torch.isclose(weights[others, 0], pi[expert_ids[others, 0]])
    share = kept.double().mean().item()  # P(factor 1 | not the likeliest) = 1/4
    assert abs(share - 0.25) < 5 * (0.25 * 0.75 / int(others.sum())) ** 0.5


def test_layer_routes_with_grin_and_the_router_weight_gets_the_estimator() -> None:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(hidden_size=16, num_experts=E, intermediate_size=24, router_gradient="grin",
                          grin_eps=EPS))
    with torch.no_grad():
        layer.router.weight.mul_(60.0)  # logits of order 1, so several experts are eligible
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(9)
    routing = layer.router(x)
    upstream = torch.randn(routing.weights.shape, generator=torch.Generator().manual_seed(5))
    (routing.weights * upstream).sum().backward()
    _, grad = _plain_estimator(routing.logits.detach(), routing.expert_ids, upstream, EPS)
    torch.testing.assert_close(layer.router.weight.grad.double(), grad.t() @ x.double(), atol=1e-5, rtol=1e-5)
    assert bool(routing.kept.all())  # dropless by default
    out, losses = layer(x, return_losses=True)
    assert out.shape == x.shape and int(losses.expert_load.sum()) == 32 * K


def test_grin_refuses_gumbel_noise() -> None:
    with pytest.raises(ValueError, match="noise='gumbel' with router_gradient='grin'"):
        MoEConfig(hidden_size=8, num_experts=4, intermediate_size=8, router_gradient="grin", noise="gumbel")


def test_equals_hf_phimoe_sparsemixer() -> None:
    """HF's PhiMoE (the GRIN authors' model) with the same seed: the same experts, the same gradient.
    The second draw's midpoint coin is not compared: HF draws its uniform twice there."""
    phimoe = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    for training in (True, False):
        ours, theirs = _logits(seed=2).requires_grad_(), _logits(seed=2).requires_grad_()
        torch.manual_seed(11)
        expert_ids, weights = sparse_mixer_v2(ours, K, EPS, training=training)
        torch.manual_seed(11)
        hf_weights, hf_ids = phimoe.sparsemixer(theirs, jitter_eps=EPS, training=training, top_k=K)
        assert torch.equal(expert_ids, hf_ids)
        # HF writes the factors as 0.3333 and 0.3333 + 0.6667 (not exactly 1/3 and 1).
        torch.testing.assert_close(weights[:, 0], hf_weights[:, 0], atol=1e-4, rtol=1e-3)
        upstream = torch.randn(weights.shape, generator=torch.Generator().manual_seed(6))
        (weights * upstream).sum().backward()
        (hf_weights * upstream).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-5)
