"""GRIN's router: SparseMixer-v2 sampling and its gradient estimator for the expert choice.

From "GRIN: GRadient-INformed MoE" (Liu et al., 2024, arXiv:2409.12136, section 2), which builds
on SparseMixer ("Sparse Backpropagation for MoE Training", Liu et al., 2023, arXiv:2310.00811).
The straight-through router of :mod:`plait.moe_layers.router` passes gradient only through the
combine weights of the experts it picked; the choice itself gets none. SparseMixer-v2 makes the
choice a sample and estimates its gradient:

1. **Sampling instead of TopK.** The ``k`` experts are drawn one after another. For draw ``j``,
   with ``z`` the token's router logits, ``m`` the largest logit among experts not drawn yet and
   ``eps`` = :attr:`~plait.moe_layers.config.MoEConfig.grin_eps`, an expert ``e`` not drawn yet is
   eligible when ``(m - z_e) / max(|z_e|, m) <= 2 eps`` (a relative gap to the best; the others
   are masked out, which keeps the routing sparse). ``pi_j`` is the softmax of the eligible
   logits; in training the expert is drawn from ``pi_j`` (Gumbel-max: ``argmax(z - log E)``,
   ``E ~ Exp(1)``), in eval mode it is the argmax.
2. **Combine weight.** The ``j``-th expert's weight is its probability ``pi_j[e_j]``. In training
   it is multiplied by the midpoint factor of Heun's third-order method: ``1`` when the draw is the
   most likely eligible expert, or otherwise with probability 1/4; ``1/3`` otherwise.
3. **Gradient.** Backward treats the weight as ``pi_j[e_j]`` (the factor does not enter it): the
   logits receive ``g_j * pi_j[e_j] * (onehot(e_j) - pi_j)``, ``g_j`` the gradient reaching the
   weight; masked experts receive nothing.

There is no capacity drop in GRIN's setting; :class:`~plait.moe_layers.config.MoEConfig` leaves
``capacity_factor=None`` (dropless) by default and applies a capacity if one is set. The random
draws come from torch's global generator in this order per draw: ``Exp(1)`` for every logit,
then one uniform per token for the midpoint coin, so a seeded run is reproducible.
"""

from __future__ import annotations

import torch

MIDPOINT_SCALE = 1.0 / 3.0  # the weight's factor when the midpoint coin says so (see point 2)
MIDPOINT_KEEP = 0.25  # probability that a draw other than the most likely keeps factor 1


class _ChoiceWeight(torch.autograd.Function):
    """``pi[e] * factor`` forward; backward the gradient of ``pi[e]`` alone (see point 3)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, pi: torch.Tensor, choice: torch.Tensor,
                factor: torch.Tensor) -> torch.Tensor:
        chosen = pi.gather(-1, choice)
        ctx.save_for_backward(pi, choice, chosen)
        return chosen * factor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        pi, choice, chosen = ctx.saved_tensors
        scaled = grad * chosen  # [T, 1]: g * pi[e]
        grad_logits = -pi * scaled
        grad_logits.scatter_add_(-1, choice, scaled)
        return grad_logits, None, None, None


def sparse_mixer_v2(logits: torch.Tensor, top_k: int, eps: float, *, training: bool) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """Choose ``top_k`` experts per token and their combine weights (see the module docstring).

    Args:
        logits: ``[T, E]`` fp32 router logits (differentiable).
        top_k: experts per token.
        eps: the relative logit gap that bounds eligibility (``grin_eps``).
        training: sample and apply the midpoint factor (else argmax, factor 1).

    Returns:
        ``(expert_ids [T, k] int64, weights [T, k] fp32)``; ``weights`` carry the estimator's gradient
        to ``logits``.
    """
    detached = logits.detach()
    drawn = torch.zeros_like(detached, dtype=torch.bool)
    choices, weights = [], []
    for _ in range(top_k):
        masked = _eligible(detached, drawn, eps)
        pi = torch.softmax(masked, dim=-1)
        if training:
            noise = torch.empty_like(masked).exponential_().log()
            choice = (masked - noise).argmax(dim=-1, keepdim=True)
            coin = torch.rand_like(pi[:, :1]) > 1.0 - MIDPOINT_KEEP
            likeliest = choice == pi.argmax(dim=-1, keepdim=True)
            factor = torch.where(likeliest | coin, 1.0, MIDPOINT_SCALE).to(pi.dtype)
        else:
            choice = masked.argmax(dim=-1, keepdim=True)
            factor = torch.ones_like(pi[:, :1])
        weights.append(_ChoiceWeight.apply(logits, pi, choice, factor))
        choices.append(choice)
        drawn.scatter_(-1, choice, True)
    return torch.cat(choices, dim=-1), torch.cat(weights, dim=-1)


def _eligible(logits: torch.Tensor, drawn: torch.Tensor, eps: float) -> torch.Tensor:
    remaining = logits.masked_fill(drawn, float("-inf"))
    best = remaining.amax(dim=-1, keepdim=True)
    gap = (best - logits) / logits.abs().clamp(min=best)
    return remaining.masked_fill(gap > 2 * eps, float("-inf"))
