"""Top-k routing: scores, router noise, expert capacity with drop policies, and the auxiliary losses.

The router turns ``[T, H]`` tokens into, per token, ``top_k`` expert ids and combine weights, then
decides which of those ``T * top_k`` assignments fit in their expert's capacity. Everything is
computed in fp32 (the small logit differences that decide the ranking vanish in bf16).

By default the gradient reaching the router is the straight-through one every MoE of this family
uses: the combine weights are differentiable functions of the logits, the choice of experts is not.
``MoEConfig(router_gradient="grin")`` samples the choice and estimates its gradient instead
(:mod:`plait.moe_layers.grin`).

Losses, both returned for the user to add to the training loss with their own coefficients:

* load balancing (Switch Transformer, Fedus et al. 2021, eq. 4, generalised to top-k):
  ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``T * k`` assignments (before capacity
  drops) that chose expert ``e`` and ``P_e`` the mean router probability of ``e``. It is 1 for a
  perfectly uniform router at any ``k``. (HF Mixtral's ``load_balancing_loss_func`` equals ``k``
  times this value.)
* router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``mean_t (logsumexp_e logits_te)^2``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from plait.moe_layers.config import MoEConfig
from plait.moe_layers.grin import sparse_mixer_v2


@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's decision for ``T`` tokens.

    Attributes:
        logits: ``[T, E]`` fp32 router logits (clean, before any Gumbel noise).
        probs: ``[T, E]`` fp32 softmax of ``logits``.
        expert_ids: ``[T, k]`` int64 chosen experts, best first.
        weights: ``[T, k]`` fp32 combine weights (differentiable in the logits).
        kept: ``[T, k]`` bool: the assignment fits its expert's capacity (all true when dropless).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor


@dataclasses.dataclass(frozen=True)
class MoELosses:
    """Auxiliary losses and load statistics of one MoE forward.

    Attributes:
        load_balancing: the Switch load-balancing loss (see the module docstring), a scalar tensor.
        z_loss: the router z-loss, a scalar tensor.
        expert_load: ``[E]`` int64 assignments each expert computed (after capacity drops).
        kept: ``[T, k]`` bool, the assignments kept after capacity drops.
    """

    load_balancing: torch.Tensor
    z_loss: torch.Tensor
    expert_load: torch.Tensor
    kept: torch.Tensor

    @property
    def dropped(self) -> int:
        """Assignments dropped for capacity in this forward (0 when dropless).

        Counted when read, not in the forward: reading a count is a device sync (and, under
        torch.compile, a graph break), which a forward that nobody asks this of should not pay.
        """
        return int(self.kept.numel() - int(self.kept.sum()))


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (see the module docstring).

    Args:
        probs: ``[T, E]`` router probabilities.
        expert_ids: ``[T, k]`` chosen experts (before capacity drops).

    Returns:
        A scalar fp32 tensor, differentiable through ``probs``.
    """
    num_experts = probs.shape[1]
    if probs.shape[0] == 0:
        return probs.sum() * 0
    # index_add_ instead of bincount: bincount sizes its output from the data (a graph break under
    # torch.compile); the counts are the same integers.
    ids = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    fraction = counts.to(probs.dtype) / expert_ids.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t (logsumexp_e logits)^2``; a scalar fp32 tensor (zero for no tokens)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def capacity_keep(expert_ids: torch.Tensor, priority: torch.Tensor | None, num_experts: int,
                  capacity: int | None, *, token_order: bool = False) -> torch.Tensor:
    """Which assignments fit in their expert's capacity.

    Assignments are ranked per expert; the first ``capacity`` of each expert are kept. With
    ``priority=None`` the rank is by position with all first choices before any second choice
    (GShard's order: token 0 slot 0, token 1 slot 0, ..., token 0 slot 1, ...), or with
    ``token_order=True`` by token alone (token 0's choices, then token 1's, ...: DeepSpeed's
    ``topkgating(drop_policy="position")``); otherwise by decreasing ``priority`` (ties by
    position order).

    Args:
        expert_ids: ``[T, k]`` chosen experts.
        priority: ``[T, k]`` scores (higher is kept first) or ``None`` for position order.
        num_experts: ``E``.
        capacity: assignments per expert, or ``None`` to keep everything.
        token_order: with ``priority=None``, rank by token rather than first choices first.

    Returns:
        ``[T, k]`` bool.
    """
    if capacity is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    slot_major = expert_ids.t().reshape(-1)
    order = torch.arange(slot_major.numel(), device=expert_ids.device)
    if token_order and priority is None:  # slot-major index s*T + t, visited token by token
        order = order.view(expert_ids.shape[1], expert_ids.shape[0]).t().reshape(-1)
    if priority is not None:
        order = torch.argsort(-priority.detach().t().reshape(-1), stable=True)
    by_expert = order[torch.argsort(slot_major[order], stable=True)]
    # index_add_, not bincount (an output sized from the data: a graph break under torch.compile).
    counts = torch.zeros(num_experts, dtype=torch.long, device=slot_major.device).index_add_(
        0, slot_major, torch.ones_like(slot_major))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[by_expert] = torch.arange(by_expert.numel(), device=order.device) - starts[slot_major[by_expert]]
    return (rank < capacity).view(expert_ids.shape[1], expert_ids.shape[0]).t()


def renormalize_kept(weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Each token's kept weights divided by their sum (dropped ones 0), DeepSpeed's ``top2gating``.

    Args:
        weights: ``[T, k]`` combine weights.
        kept: ``[T, k]`` bool from :func:`capacity_keep`.

    Returns:
        ``[T, k]`` weights; a token with nothing kept gets zeros (the sum is clamped at fp32 eps).
    """
    masked = weights * kept.to(weights.dtype)
    return masked / masked.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(masked.dtype).eps)


def gumbel_noise(like: torch.Tensor) -> torch.Tensor:
    """``Gumbel(0, 1)`` samples shaped like ``like``, from torch's global generator.

    torch's own Gumbel sampler, one draw of ``like``'s shape: the draw DeepSpeed's gating makes
    (``gumbel_rsample``), so from the same torch seed the same experts are picked.
    """
    zero, one = torch.zeros((), device=like.device), torch.ones((), device=like.device)
    return torch.distributions.Gumbel(zero, one).rsample(like.shape)


def first_then_sampled(logits: torch.Tensor, top_k: int, scale: float) -> torch.Tensor:
    """Each token's best expert, then ``top_k - 1`` more picked on Gumbel-perturbed logits.

    Args:
        logits: router logits ``[T, E]``.
        top_k: experts per token, ``>= 2``.
        scale: multiplier of the ``Gumbel(0, 1)`` noise (``1.0`` is DeepSpeed's top-2 sampling).

    Returns:
        ``[T, top_k]`` expert ids, the clean argmax first.
    """
    first = logits.argmax(dim=-1, keepdim=True)
    perturbed = (logits + scale * gumbel_noise(logits)).scatter(1, first, float("-inf"))
    return torch.cat([first, perturbed.topk(top_k - 1, dim=-1).indices], dim=1)


class Router(nn.Module):
    """Linear router with top-k selection, noise and capacity (see :class:`MoEConfig`).

    The weight is ``[E, H]`` like ``nn.Linear(H, E, bias=False)`` and HF Mixtral's
    ``MixtralTopKRouter.weight``, so converted models keep their router as is.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` (``[T, H]``); noise and the training capacity apply in training mode only."""
        cfg = self.config
        noisy = self.training and cfg.noise != "none" and cfg.noise_eps > 0
        if noisy and cfg.noise == "jitter":
            x = x * torch.empty_like(x).uniform_(1.0 - cfg.noise_eps, 1.0 + cfg.noise_eps)
        logits = F.linear(x.float(), self.weight.float())
        probs = F.softmax(logits, dim=-1)
        if cfg.router_gradient == "grin":
            expert_ids, weights = sparse_mixer_v2(logits, cfg.top_k, cfg.grin_eps, training=self.training)
            return self._routing(x, logits, probs, expert_ids, weights)
        select_on = logits
        if noisy and cfg.noise == "gumbel":
            select_on = logits + cfg.noise_eps * gumbel_noise(logits)
        if noisy and cfg.noise == "gumbel_after_first":
            expert_ids = first_then_sampled(logits.detach(), cfg.top_k, cfg.noise_eps)
        else:
            expert_ids = select_on.detach().topk(cfg.top_k, dim=-1).indices
        if cfg.score_order == "topk_softmax":
            weights = F.softmax(logits.gather(1, expert_ids), dim=-1)
        else:
            weights = probs.gather(1, expert_ids)
            if cfg.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return self._routing(x, logits, probs, expert_ids, weights)

    def _routing(self, x: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor) -> Routing:
        """Apply the capacity (drop policy) to a choice of experts."""
        cfg = self.config
        capacity = cfg.capacity(x.shape[0], training=self.training)
        priority = None
        if cfg.drop_policy == "probability":
            priority = probs.gather(1, expert_ids)
        elif cfg.drop_policy == "random" and capacity is not None:
            # One uniform draw per (token, expert), as DeepSpeed's top1gating(use_rts=True) draws it,
            # so the same seed keeps the same tokens.
            priority = torch.rand(probs.shape, device=probs.device).gather(1, expert_ids)
        kept = capacity_keep(expert_ids, priority, cfg.num_experts, capacity, token_order=cfg.drop_policy == "token")
        if cfg.renormalize_after_drops:
            weights = renormalize_kept(weights, kept)
        return Routing(logits=logits, probs=probs, expert_ids=expert_ids, weights=weights, kept=kept)
