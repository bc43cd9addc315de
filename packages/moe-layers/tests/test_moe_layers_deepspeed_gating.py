"""DeepSpeed's gating reproduced by MoEConfig switches, checked against DeepSpeed's own
``top1gating`` / ``top2gating`` / ``topkgating`` (``deepspeed.moe.sharded_moe``, run on the CPU) on
skewed logits where the capacity binds: combine weights and dispatch masks (summed over DeepSpeed's
capacity slots), the aux loss and the expert counts before drops."""

from __future__ import annotations

import os

import pytest
import torch

from plait.moe_layers import MoE, MoEConfig, Router

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")

E, T = 4, 24


def _skewed_logits(seed: int) -> torch.Tensor:
    """Most tokens prefer experts 0 and 1, so their capacity binds for first and second choices."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen)
    logits[:, 0] += 2.0
    logits[:, 1] += 1.0
    return logits


def _route(config: MoEConfig, logits: torch.Tensor, seed: int | None = None):
    """Plait's routing of tokens whose router logits are exactly ``logits`` (identity router),
    with torch seeded by ``seed`` (if given) right before the routing draws anything."""
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    if seed is not None:
        torch.manual_seed(seed)
    routing = router(logits.clone())
    dense = torch.zeros(T, E).scatter_add_(1, routing.expert_ids, routing.weights.detach() * routing.kept)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, routing.expert_ids, routing.kept)
    return routing, dense, mask


def _aux(config: MoEConfig, logits: torch.Tensor, seed: int | None = None) -> torch.Tensor:
    """The layer's load-balancing loss for tokens whose router logits are ``logits``."""
    layer = MoE(config)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(E))
    if seed is not None:
        torch.manual_seed(seed)
    _, losses = layer(logits.clone(), return_losses=True)
    return losses.load_balancing


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_top2_matches_deepspeed_top2gating(seed, capacity_factor):
    logits = _skewed_logits(seed)
    config = MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, top_k=2, capacity_factor=capacity_factor,
                       min_capacity=1, drop_policy="position", renormalize_after_drops=True,
                       aux_loss_choices="first")
    routing, dense, mask = _route(config, logits)
    l_aux, combine, dispatch, exp_counts = sharded_moe.top2gating(
        logits.clone(), capacity_factor, 1, drop_tokens=True, top2_2nd_expert_sampling=False)
    assert int((~routing.kept).sum()) > 0, "the capacity must bind for the test to mean anything"
    assert torch.equal(mask, dispatch.any(dim=-1))
    torch.testing.assert_close(dense, combine.sum(dim=-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_aux(config, logits), l_aux, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.bincount(routing.expert_ids.reshape(-1), minlength=E), exp_counts)
    # A token that lost its second expert gets weight 1 on its first.
    lost_second = routing.kept[:, 0] & ~routing.kept[:, 1]
    assert bool(lost_second.any())
    torch.testing.assert_close(routing.weights[lost_second, 0], torch.ones(int(lost_second.sum())))


@pytest.mark.parametrize("seed", [0, 3])
def test_top2_second_expert_sampling_matches_deepspeeds_default(seed):
    """``top2gating``'s default ``top2_2nd_expert_sampling=True``: the same torch seed before
    each call, the same Gumbel draw, so the same second experts, weights and drops."""
    logits = _skewed_logits(seed)
    config = MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, top_k=2, capacity_factor=0.5,
                       min_capacity=1, drop_policy="position", renormalize_after_drops=True,
                       aux_loss_choices="first", noise="gumbel_after_first", noise_eps=1.0)
    routing, dense, mask = _route(config, logits, seed=100 + seed)
    torch.manual_seed(100 + seed)
    l_aux, combine, dispatch, exp_counts = sharded_moe.top2gating(
        logits.clone(), 0.5, 1, drop_tokens=True, top2_2nd_expert_sampling=True)
    clean_second = logits.topk(2, dim=-1).indices[:, 1]
    assert bool((routing.expert_ids[:, 1] != clean_second).any()), "the sampling must change a second choice"
    assert torch.equal(routing.expert_ids[:, 0], logits.argmax(dim=-1))
    assert int((~routing.kept).sum()) > 0
    assert torch.equal(mask, dispatch.any(dim=-1))
    torch.testing.assert_close(dense, combine.sum(dim=-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_aux(config, logits, seed=100 + seed), l_aux, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.bincount(routing.expert_ids.reshape(-1), minlength=E), exp_counts)


def test_second_expert_sampling_is_training_only_and_needs_two_experts():
    config = MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, top_k=2, noise="gumbel_after_first",
                       noise_eps=1.0)
    router = Router(config).eval()
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    logits = _skewed_logits(1)
    assert torch.equal(router(logits).expert_ids, logits.topk(2, dim=-1).indices)
    with pytest.raises(ValueError, match="gumbel_after_first.*top_k >= 2"):
        MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, top_k=1, noise="gumbel_after_first")
    with pytest.raises(ValueError, match="'gumbel_after_first' with router_gradient='grin'"):
        MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, noise="gumbel_after_first",
                  router_gradient="grin")


def test_plain_renormalisation_differs_where_deepspeed_renormalises_after_drops():
    logits = _skewed_logits(0)
    base = dict(hidden_size=E, num_experts=E, intermediate_size=8, top_k=2, capacity_factor=0.5, min_capacity=1)
    _, dense_before, _ = _route(MoEConfig(**base), logits)
    _, dense_after, _ = _route(MoEConfig(**base, renormalize_after_drops=True), logits)
    _, combine, _, _ = sharded_moe.top2gating(logits.clone(), 0.5, 1, top2_2nd_expert_sampling=False)
    assert not torch.allclose(dense_before, combine.sum(dim=-1))
    torch.testing.assert_close(dense_after, combine.sum(dim=-1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_top1_matches_deepspeed_top1gating_up_to_which_tokens_are_kept(capacity_factor):
    """DeepSpeed's ``top1gating`` picks the tokens an over-full expert keeps with ``torch.topk``
    over a 0/1 mask (``use_rts=False``; random with ``use_rts=True``), so which tokens survive is
    not token order. Everything else is equal: the aux loss, the counts before drops, how many
    each expert keeps, and a kept token's weight (its raw probability)."""
    logits = _skewed_logits(2)
    config = MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, top_k=1, capacity_factor=capacity_factor,
                       min_capacity=1, renormalize=False, drop_policy="position", aux_loss_choices="first")
    routing, dense, mask = _route(config, logits)
    l_aux, combine, dispatch, exp_counts = sharded_moe.top1gating(
        logits.clone(), capacity_factor, 1, noisy_gate_policy=None, drop_tokens=True, use_rts=False)
    assert int((~routing.kept).sum()) > 0
    ds_mask = dispatch.any(dim=-1)
    assert torch.equal(mask.sum(dim=0), ds_mask.sum(dim=0))
    both = mask & ds_mask
    torch.testing.assert_close(dense[both], combine.sum(dim=-1)[both], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_aux(config, logits), l_aux, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.bincount(routing.expert_ids.reshape(-1), minlength=E), exp_counts)


def test_bad_switches_are_refused_by_name():
    with pytest.raises(ValueError, match="aux_loss_choices"):
        MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, aux_loss_choices="second")
    with pytest.raises(ValueError, match="renormalize_after_drops"):
        MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, renormalize_after_drops=1)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(("ours", "theirs"), [("token", "position"), ("probability", "probs")])
def test_topk_matches_deepspeed_topkgating(k, ours, theirs):
    logits = _skewed_logits(3)
    config = MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, top_k=k, capacity_factor=0.5,
                       min_capacity=1, drop_policy=ours, renormalize_after_drops=True)
    routing, dense, mask = _route(config, logits)
    l_aux, combine, dispatch, exp_counts = sharded_moe.topkgating(logits.clone(), k, 0.5, 1, drop_policy=theirs)
    assert int((~routing.kept).sum()) > 0
    assert torch.equal(mask, dispatch.any(dim=-1))
    torch.testing.assert_close(dense, combine.sum(dim=-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_aux(config, logits), l_aux, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.bincount(routing.expert_ids.reshape(-1), minlength=E), exp_counts)


def test_token_order_differs_from_first_choices_first_where_it_binds():
    logits = _skewed_logits(3)
    base = dict(hidden_size=E, num_experts=E, intermediate_size=8, top_k=2, capacity_factor=0.5, min_capacity=1)
    _, _, by_token = _route(MoEConfig(**base, drop_policy="token"), logits)
    _, _, by_position = _route(MoEConfig(**base, drop_policy="position"), logits)
    assert not torch.equal(by_token, by_position)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_random_token_selection_matches_deepspeed_top1gating_with_rts(capacity_factor):
    """DeepSpeed's MoE layer defaults to ``use_rts=True``: an over-full expert keeps the tokens with
    the highest uniform draws. ``drop_policy="random"`` draws the same ``[T, E]`` uniforms, so from the
    same torch seed the same tokens are kept."""
    logits = _skewed_logits(4)
    config = MoEConfig(hidden_size=E, num_experts=E, intermediate_size=8, top_k=1, capacity_factor=capacity_factor,
                       min_capacity=1, renormalize=False, drop_policy="random", aux_loss_choices="first")
    router = Router(config)  # built first: its initialisation draws from the same generator
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    torch.manual_seed(7)
    routing = router(logits.clone())
    dense = torch.zeros(T, E).scatter_add_(1, routing.expert_ids, routing.weights.detach() * routing.kept)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, routing.expert_ids, routing.kept)
    torch.manual_seed(7)
    l_aux, combine, dispatch, exp_counts = sharded_moe.top1gating(
        logits.clone(), capacity_factor, 1, noisy_gate_policy=None, drop_tokens=True, use_rts=True)
    assert int((~routing.kept).sum()) > 0
    assert torch.equal(mask, dispatch.any(dim=-1))
    torch.testing.assert_close(dense, combine.sum(dim=-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_aux(config, logits), l_aux, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.bincount(routing.expert_ids.reshape(-1), minlength=E), exp_counts)
