"""DeepSpeed's MoE layer, by its own arguments, computed by plait's router and dispatch.

``plait.moe_layers.deepspeed.MoE(hidden_size, expert, num_experts, k=..., ...)`` takes the
arguments of ``deepspeed.moe.layer.MoE`` and returns what it returns, ``(output, l_aux,
exp_counts)``, so a model written against DeepSpeed's layer changes one import line. The gating
maps onto :class:`~plait.moe_layers.MoEConfig` switches that reproduce DeepSpeed's (tested against
``top1gating``/``top2gating``/``topkgating`` and against the whole DeepSpeed layer); the experts are
copies of the given module, as DeepSpeed makes them; a DeepSpeed state dict loads under its own key
names. deepspeed itself is not needed.

``ep_size > 1`` lays the ranks out as DeepSpeed does (``ep_size`` consecutive ranks per
expert-parallel group, each keeping ``num_experts / ep_size`` consecutive experts; the ranks with
the same place in their groups form the expert-data-parallel groups) through
:func:`~plait.moe_layers.make_expert_parallel_groups` and
:func:`~plait.moe_layers.apply_expert_parallel`. The groups are made once per ``ep_size`` and
shared by every layer of that size, as DeepSpeed names them ``ep_size_<n>``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.moe_layers.config import MoEConfig
from plait.moe_layers.layer import MoE as PlaitMoE
from plait.moe_layers.parallel import ExpertParallelGroups, apply_expert_parallel, make_expert_parallel_groups

# DeepSpeed's key prefixes -> this layer's (the router's weight, the experts, the residual MLP).
_DEEPSPEED_KEYS = (("deepspeed_moe.gate.wg.weight", "router.weight"),
                   ("deepspeed_moe.experts.deepspeed_experts.", "experts.experts."),
                   ("mlp.", "dense."))
_JITTER_EPS = 1e-2  # DeepSpeed's multiplicative_jitter epsilon
# ep_size -> (the default group it was made under, its groups): one set per size, as DeepSpeed's
# "ep_size_<n>" groups, remade if the default process group is replaced.
_GROUPS: dict[int, tuple[Any, ExpertParallelGroups]] = {}


def deepspeed_moe_config(hidden_size: int, num_experts: int = 1, k: int = 1, capacity_factor: float = 1.0,
                         eval_capacity_factor: float = 1.0, min_capacity: int = 4, use_residual: bool = False,
                         noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
                         top2_2nd_expert_sampling: bool = True) -> MoEConfig:
    """The :class:`MoEConfig` that routes as ``deepspeed.moe.layer.MoE`` with these arguments does.

    Args:
        hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
        use_residual, noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling:
            DeepSpeed's arguments of the same names, with its defaults.

    Returns:
        The configuration. ``intermediate_size`` is set to ``hidden_size``: the experts are the
        given module's copies, not plait's gated MLP, so it is not used.

    Raises:
        ValueError: ``noisy_gate_policy`` is not one DeepSpeed accepts, or ``"Jitter"`` with
            ``k=2`` and the second-expert sampling on (two noises; plait's router takes one).
    """
    policy = None if noisy_gate_policy in (None, "None") else noisy_gate_policy
    if policy not in (None, "Jitter", "RSample"):
        raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: DeepSpeed accepts None, 'None', 'Jitter' or "
                         "'RSample'.")
    routing: dict[str, Any]
    if k == 1:  # top1gating: the raw probability, drops by random token selection or by position
        routing = dict(renormalize=False, drop_policy="random" if use_rts else "position", aux_loss_choices="first")
        if policy == "RSample":
            routing.update(noise="gumbel", noise_eps=1.0)
    elif k == 2:  # top2gating: first choices before second, renormalised after drops
        routing = dict(drop_policy="position", renormalize_after_drops=True, aux_loss_choices="first")
        if top2_2nd_expert_sampling:
            routing.update(noise="gumbel_after_first", noise_eps=1.0)
    else:  # topkgating with its default drop_policy="probs"
        routing = dict(drop_policy="probability", renormalize_after_drops=True)
    if policy == "Jitter":
        if routing.get("noise"):
            raise ValueError("noisy_gate_policy='Jitter' with k=2 and top2_2nd_expert_sampling=True: plait's router "
                             "takes one noise; pass top2_2nd_expert_sampling=False or noisy_gate_policy=None.")
        routing.update(noise="jitter", noise_eps=_JITTER_EPS)
    return MoEConfig(hidden_size=hidden_size, num_experts=num_experts, intermediate_size=hidden_size, top_k=k,
                     capacity_factor=capacity_factor if drop_tokens else None,
                     eval_capacity_factor=eval_capacity_factor if drop_tokens else None,
                     min_capacity=min_capacity, residual=use_residual, **routing)


class MoE(PlaitMoE):
    """``deepspeed.moe.layer.MoE``'s constructor and return value on plait's MoE layer.

    Args:
        hidden_size: width of the tokens.
        expert: the expert module, copied ``num_experts`` times (``[n, H] -> [n, H]``, or a tuple
            whose first item is that, as DeepSpeed takes it); with ``use_residual`` it is also the
            dense residual MLP itself, as in DeepSpeed.
        num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, use_residual,
        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling: as DeepSpeed's
            (:func:`deepspeed_moe_config` says what each becomes).
        ep_size: ranks that split the experts (DeepSpeed's layout, see the module docstring);
            above 1 this rank keeps its ``num_experts / ep_size`` experts and the constructor is
            a collective call the first time a size is used (every rank builds its layers in the
            same order, after ``torch.distributed`` is initialised).
        use_tutel, enable_expert_tensor_parallelism: must be ``False``.

    Raises:
        ValueError: an argument plait cannot honour, named with what to do instead, or an
            ``ep_size`` that does not divide ``num_experts`` or the world size.
        RuntimeError: ``ep_size > 1`` without ``torch.distributed`` initialised.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        _refuse_unsupported(num_experts, ep_size, use_tutel, enable_expert_tensor_parallelism)
        config = deepspeed_moe_config(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                                      min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts,
                                      top2_2nd_expert_sampling)
        super().__init__(config, experts=[copy.deepcopy(expert) for _ in range(num_experts)])
        # DeepSpeed's gate is nn.Linear(hidden, E, bias=False) with Linear's initialisation.
        nn.init.kaiming_uniform_(self.router.weight, a=5 ** 0.5)
        if use_residual:
            self.dense = expert  # DeepSpeed's residual MLP is the given module itself, not a copy
        if ep_size > 1:
            apply_expert_parallel(self, _expert_parallel_groups(ep_size))
        self._register_load_state_dict_pre_hook(_rename_deepspeed_keys)
        self._last_expert_ids: torch.Tensor | None = None
        self.router.register_forward_hook(self._remember_choice)

    def _remember_choice(self, module: nn.Module, args: Any, routing: Any) -> None:
        self._last_expert_ids = routing.expert_ids

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """DeepSpeed's forward: ``(output, l_aux, exp_counts)``.

        Args:
            hidden_states: ``[..., H]`` tokens.
            used_token: must be ``None`` (DeepSpeed's top-1 token mask is not supported).

        Returns:
            The output (``hidden_states``' shape), the load-balancing loss (DeepSpeed's ``l_aux``),
            and each expert's number of assignments before capacity drops (``exp_counts``).
        """
        if used_token is not None:
            raise ValueError("MoE(used_token=...) is not supported by plait's DeepSpeed-style layer; mask the "
                             "unused tokens out of hidden_states instead.")
        out, losses = super().forward(hidden_states, return_losses=True)
        ids = self._last_expert_ids.reshape(-1)  # index_add_, not bincount: no data-sized output under compile
        counts = torch.zeros(self.config.num_experts, dtype=torch.long, device=ids.device).index_add_(
            0, ids, torch.ones_like(ids))
        return out, losses.load_balancing, counts


def _expert_parallel_groups(ep_size: int) -> ExpertParallelGroups:
    """The groups of ``ep_size``, made on first use (a collective call) and shared afterwards."""
    world = dist.group.WORLD if dist.is_initialized() else None
    cached = _GROUPS.get(ep_size)
    if cached is None or cached[0] is not world:
        _GROUPS[ep_size] = (world, make_expert_parallel_groups(ep_size))
    return _GROUPS[ep_size][1]


def _refuse_unsupported(num_experts: int, ep_size: int, use_tutel: bool, expert_tp: bool) -> None:
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"MoE(ep_size={ep_size!r}) must be a positive int (1: no expert parallelism).")
    if isinstance(num_experts, int) and num_experts % ep_size:
        raise ValueError(f"MoE(num_experts={num_experts}, ep_size={ep_size}): ep_size must divide num_experts; "
                         f"use one of {[d for d in range(1, num_experts + 1) if num_experts % d == 0]}.")
    if use_tutel:
        raise ValueError("MoE(use_tutel=True): Tutel is not used by plait; pass use_tutel=False (plait's grouped "
                         "dispatch is its own).")
    if expert_tp:
        raise ValueError("MoE(enable_expert_tensor_parallelism=True) is not supported; pass False.")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"MoE(num_experts={num_experts!r}) must be a positive int.")


def _rename_deepspeed_keys(state_dict: dict, prefix: str, *args: Any) -> None:
    """Load hook: DeepSpeed's key names (``deepspeed_moe.gate.wg.weight``, ...) become this layer's."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        for theirs, ours in _DEEPSPEED_KEYS:
            if rest.startswith(theirs):
                state_dict[prefix + ours + rest[len(theirs):]] = state_dict.pop(key)
                break
