"""The MoE layer's configuration: one frozen, keyword-only dataclass checked before any weight exists."""

from __future__ import annotations

import dataclasses
import math

SCORE_ORDERS = ("softmax_topk", "topk_softmax")
DROP_POLICIES = ("position", "probability", "token", "random")
NOISE_KINDS = ("none", "jitter", "gumbel", "gumbel_after_first")
ROUTER_GRADIENTS = ("straight_through", "grin")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
AUX_LOSS_CHOICES = ("all", "first")


def _positive_int(name: str, value: object, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MoEConfig.{name}={value!r} must be a positive int; {fix}.")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"MoEConfig.{name}={value!r} is not supported; use one of {', '.join(map(repr, choices))}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """What one Mixture-of-Experts layer computes.

    Attributes:
        hidden_size: width ``H`` of the tokens coming in and going out.
        num_experts: number of experts ``E`` (across all expert-parallel ranks).
        intermediate_size: width ``I`` of each expert's gated MLP ``down(act(gate x) * up x)``.
        top_k: experts per token (1 = Switch, 2 = GShard/Mixtral), ``1 <= top_k <= num_experts``.
        score_order: ``"softmax_topk"`` takes the softmax over all ``E`` logits, then the top-k
            probabilities (Mixtral, Switch); ``"topk_softmax"`` takes the top-k logits, then a softmax
            over those ``k`` only (Qwen3-MoE's ``norm_topk_prob``, DeepSeek-V2's ``greedy`` with
            renormalisation). The aux loss always uses the full softmax.
        renormalize: with ``"softmax_topk"``, divide the kept ``k`` probabilities by their sum so a
            token's weights add to 1 (Mixtral); ignored by ``"topk_softmax"`` (already normalised).
        capacity_factor: ``None`` for dropless routing (every assignment is computed), else each
            expert takes at most ``ceil(capacity_factor * tokens * top_k / num_experts)`` assignments
            per forward (at least ``min_capacity``) and the rest are dropped by ``drop_policy``.
            Under expert parallelism the tokens are those of the calling rank (as DeepSpeed).
        eval_capacity_factor: the capacity factor in ``eval()`` mode; ``None`` = same as training.
        min_capacity: the smallest capacity an expert gets (keeps tiny batches from dropping all).
        drop_policy: which assignments an over-full expert keeps: ``"position"``, in token order
            with all first choices before any second choice (GShard, DeepSpeed's ``top2gating``);
            ``"token"``, in token order alone (DeepSpeed's ``topkgating(drop_policy="position")``);
            ``"probability"``, its highest router probabilities (Switch's "batch prioritized
            routing", DeepSpeed's ``topkgating`` default ``drop_policy="probs"``); ``"random"``, a
            uniform draw per token and expert (DeepSpeed's ``top1gating(use_rts=True)``, its MoE
            layer's default: random token selection, the same tokens for the same torch seed).
        renormalize_after_drops: after capacity drops, divide each token's kept weights by their
            sum (a token that lost its second expert gets weight 1 on its first; one that lost
            every expert gets 0), as DeepSpeed's ``top2gating`` does. Use with ``top_k=2``,
            ``score_order="softmax_topk"``; DeepSpeed's ``top1gating`` keeps the raw probability
            (``renormalize=False`` and this ``False``).
        aux_loss_choices: which assignments the load-balancing loss counts in ``f_e``: ``"all"``
            (the ``T * k`` of them) or ``"first"`` (each token's first choice only, DeepSpeed's
            ``top1gating`` / ``top2gating`` ``l_aux``).
        noise: router noise in training mode only: ``"none"``; ``"jitter"`` multiplies the router's
            input by ``U(1 - noise_eps, 1 + noise_eps)`` (Switch, Mixtral's ``router_jitter_noise``);
            ``"gumbel"`` picks experts on ``logits + noise_eps * Gumbel(0, 1)`` while the combine
            weights stay the clean probabilities (DeepSpeed's ``RSample`` policy);
            ``"gumbel_after_first"`` takes each token's first expert on the clean logits and picks
            the other ``top_k - 1`` on ``logits + noise_eps * Gumbel(0, 1)`` (DeepSpeed's
            ``top2gating(top2_2nd_expert_sampling=True)``, its top-2 default, with
            ``noise_eps=1.0``; DeepSpeed also samples in eval mode, plait's eval routing stays
            deterministic).
        noise_eps: the noise scale, ``>= 0`` (``0`` turns the noise off).
        activation: the experts' gate activation (``"silu"`` = SwiGLU, ``"gelu"``, ``"gelu_tanh"``).
        residual: Residual MoE (DeepSpeed-MoE's PR-MoE building block): a dense gated MLP of the same
            width runs on every token and a learned 2-way softmax mixes it with the experts' output.
        router_gradient: how the router learns the choice of experts: ``"straight_through"`` (top-k;
            gradient through the combine weights only) or ``"grin"`` (GRIN's SparseMixer-v2: experts
            sampled in training and an estimator of the choice's gradient, see
            :mod:`plait.moe_layers.grin`). With ``"grin"`` a token's weights are each draw's
            probability, so ``score_order`` and ``renormalize`` do not apply.
        grin_eps: with ``"grin"``, the relative logit gap within which an expert may be drawn
            (``(max - z) / max(|z|, max) <= 2 * grin_eps``); PhiMoE's ``router_jitter_noise``.
    """

    hidden_size: int
    num_experts: int
    intermediate_size: int
    top_k: int = 2
    score_order: str = "softmax_topk"
    renormalize: bool = True
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    min_capacity: int = 4
    drop_policy: str = "position"
    renormalize_after_drops: bool = False
    aux_loss_choices: str = "all"
    noise: str = "none"
    noise_eps: float = 1e-2
    activation: str = "silu"
    residual: bool = False
    router_gradient: str = "straight_through"
    grin_eps: float = 1e-2

    def __post_init__(self) -> None:
        _positive_int("hidden_size", self.hidden_size, "use the width of the tokens the layer receives")
        _positive_int("num_experts", self.num_experts, "use e.g. 8")
        _positive_int("intermediate_size", self.intermediate_size, "use the experts' MLP width")
        _positive_int("top_k", self.top_k, "use 1 or 2")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; a token cannot pick "
                f"more experts than exist, use top_k <= {self.num_experts}."
            )
        _choice("score_order", self.score_order, SCORE_ORDERS)
        _choice("drop_policy", self.drop_policy, DROP_POLICIES)
        _choice("aux_loss_choices", self.aux_loss_choices, AUX_LOSS_CHOICES)
        if not isinstance(self.renormalize_after_drops, bool):
            raise ValueError(f"MoEConfig.renormalize_after_drops={self.renormalize_after_drops!r} must be True "
                             "or False.")
        _choice("noise", self.noise, NOISE_KINDS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("router_gradient", self.router_gradient, ROUTER_GRADIENTS)
        if self.router_gradient == "grin" and self.noise.startswith("gumbel"):
            raise ValueError(
                f"MoEConfig.noise={self.noise!r} with router_gradient='grin': GRIN already samples the experts; "
                "use noise='none' (or 'jitter' for input noise)."
            )
        if self.noise == "gumbel_after_first" and self.top_k < 2:
            raise ValueError(
                "MoEConfig.noise='gumbel_after_first' samples the experts after each token's first, and "
                "top_k=1 has none; use top_k >= 2, or noise='gumbel' to sample the first expert too."
            )
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(
                    f"MoEConfig.{name}={value!r} must be a positive number (e.g. 1.25) or None for dropless "
                    "routing; a capacity <= 0 would drop every token."
                )
        if not isinstance(self.min_capacity, int) or isinstance(self.min_capacity, bool) or self.min_capacity < 0:
            raise ValueError(f"MoEConfig.min_capacity={self.min_capacity!r} must be an int >= 0 (e.g. 4).")
        if not isinstance(self.noise_eps, (int, float)) or not math.isfinite(self.noise_eps) or self.noise_eps < 0:
            raise ValueError(f"MoEConfig.noise_eps={self.noise_eps!r} must be a finite number >= 0 (e.g. 0.01).")
        if not isinstance(self.grin_eps, (int, float)) or not math.isfinite(self.grin_eps) or self.grin_eps < 0:
            raise ValueError(f"MoEConfig.grin_eps={self.grin_eps!r} must be a finite number >= 0 (e.g. 0.01).")
        if self.noise == "jitter" and self.noise_eps >= 1:
            raise ValueError(
                f"MoEConfig.noise_eps={self.noise_eps} with noise='jitter' would scale inputs by <= 0; use < 1."
            )

    def capacity(self, num_tokens: int, *, training: bool) -> int | None:
        """Assignments one expert may take for ``num_tokens`` tokens; ``None`` when dropless.

        Args:
            num_tokens: tokens routed in this forward on this rank.
            training: the module's mode (selects ``eval_capacity_factor`` when false).
        """
        factor = self.capacity_factor
        if not training and self.eval_capacity_factor is not None:
            factor = self.eval_capacity_factor
        if factor is None:
            return None
        return max(self.min_capacity, math.ceil(factor * num_tokens * self.top_k / self.num_experts))
