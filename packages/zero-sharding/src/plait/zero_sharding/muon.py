"""Muon for the matrices of the hidden layers, AdamW for the rest, in one optimizer.

The Muon recipe (and DeepSpeed's Muon) orthogonalises the updates of hidden weight matrices and
trains embeddings, the output head, norms and biases with AdamW, at a learning rate of its own.
:class:`MuonWithAdamW` is that pair behind one ``torch.optim.Optimizer``: each parameter group
says which half it belongs to with ``use_muon`` (default: ``True`` for 2-D tensors), so it works
the same on a plain model and under ZeRO, where the inner optimizer only sees anonymous whole
tensors. :func:`muon_param_groups` splits a model the recipe's way::

    groups = muon_param_groups(model, head_names=("lm_head",))
    model, opt = zero_shard(model, MuonWithAdamW, ZeroConfig(stage=2), param_groups=groups,
                            lr=0.02, adamw_lr=3e-4)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from plait.zero_sharding.placements import _StateView


def muon_param_groups(model: nn.Module, *, head_names: Iterable[str] = ("lm_head",)) -> list[dict[str, Any]]:
    """Two parameter groups: Muon for the 2-D weights of hidden layers, AdamW for embeddings, the
    modules named in ``head_names`` (and weights tied to them), norms and biases.

    Args:
        model: the model (before ``zero_shard``).
        head_names: names of output-head modules (the last component of their qualified name).

    Returns:
        ``[{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]``.
    """
    heads = set(head_names)
    adamw_ids = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name.rsplit(".", 1)[-1] in heads:
            adamw_ids.update(id(p) for p in module.parameters(recurse=False))
    muon, adamw = [], []
    for p in model.parameters():
        (muon if p.ndim == 2 and id(p) not in adamw_ids else adamw).append(p)
    return [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the groups with ``use_muon`` true, ``torch.optim.AdamW`` over the
    others; ``param_groups`` are the two optimizers' own dicts, in the caller's order, so LR
    schedulers scale both learning rates alike. A whole-tensor optimizer (``whole_tensor``).

    Args:
        params: parameters or parameter groups (``use_muon`` per group; default: ``True`` when
            every tensor of the group is 2-D).
        lr: Muon's learning rate.
        adamw_lr: AdamW's learning rate.
        momentum, nesterov, ns_steps, adjust_lr_fn: Muon's options.
        adamw_betas, adamw_eps: AdamW's options.
        weight_decay: decoupled weight decay of both.

    Raises:
        ValueError: a ``use_muon`` group holds a tensor that is not 2-D (naming the group), or an
            option Muon/AdamW refuses.
    """

    whole_tensor = True

    def __init__(self, params: Iterable[Any], lr: float = 0.02, adamw_lr: float = 3e-4, *, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 weight_decay: float = 0.1) -> None:
        params = list(params)
        groups = [dict(g) for g in params] if params and isinstance(params[0], dict) else [{"params": params}]
        muon_groups, adamw_groups, self._order = [], [], []
        for index, group in enumerate(groups):
            group["params"] = list(group["params"])
            use = group.get("use_muon", all(p.ndim == 2 for p in group["params"]))
            if use and any(p.ndim != 2 for p in group["params"]):
                raise ValueError(f"param group {index} has use_muon=True but holds tensors that are not 2-D; Muon "
                                 "orthogonalises matrices only. Put biases, norms and embeddings in a group with "
                                 "use_muon=False (see muon_param_groups).")
            group["use_muon"] = bool(use)
            _own_options(group, adamw_lr, adamw_betas, adamw_eps)
            target = muon_groups if use else adamw_groups
            self._order.append((0 if use else 1, len(target)))
            target.append(group)
        self.muon = _build(lambda g: torch.optim.Muon(g, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                                      nesterov=nesterov, ns_steps=ns_steps,
                                                      adjust_lr_fn=adjust_lr_fn), muon_groups)
        self.adamw = _build(lambda g: torch.optim.AdamW(g, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                                        weight_decay=weight_decay), adamw_groups)
        # Optimizer.__init__ needs a parameter; the real groups and state are the inner ones.
        super().__init__([torch.zeros(1, requires_grad=True)], {"lr": lr, "adamw_lr": adamw_lr})
        self._link()

    def _parts(self) -> list[torch.optim.Optimizer | None]:
        return [self.muon, self.adamw]

    def _link(self) -> None:
        parts = self._parts()
        self.param_groups = [parts[o].param_groups[g] for o, g in self._order]  # type: ignore[union-attr]
        self.state = _StateView([p for p in parts if p is not None])  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One Muon step and one AdamW step. Returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts():
            if part is not None:
                part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear both halves' gradients."""
        for part in self._parts():
            if part is not None:
                part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"muon": ..., "adamw": ...}``: each half's ``state_dict()`` (``None`` when empty)."""
        return {"muon": self.muon and self.muon.state_dict(), "adamw": self.adamw and self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` returned, for the same parameter groups.

        Raises:
            ValueError: the saved state does not have the same halves.
        """
        for name, part in (("muon", self.muon), ("adamw", self.adamw)):
            saved = state_dict.get(name)
            if (saved is None) != (part is None):
                raise ValueError(f"the saved MuonWithAdamW state {'lacks' if saved is None else 'has'} a {name} half "
                                 "that this optimizer does not match; load a state saved with the same groups.")
            if part is not None:
                part.load_state_dict(saved)
        self._link()


_MUON_ONLY = ("momentum", "nesterov", "ns_steps", "adjust_lr_fn", "ns_coefficients")


def _own_options(group: dict[str, Any], adamw_lr: float, betas: tuple[float, float], eps: float) -> None:
    """Keep each half's own options in a group. Options given to the constructor may be copied
    into every group (``zero_shard`` does so): an AdamW group takes its learning rate, betas and
    eps from ``adamw_lr`` / ``adamw_betas`` / ``adamw_eps`` (the group's own, else the
    constructor's), never from Muon's ``lr``; a Muon group drops the AdamW-only keys."""
    adamw = {"lr": group.pop("adamw_lr", adamw_lr), "betas": tuple(group.pop("adamw_betas", betas)),
             "eps": group.pop("adamw_eps", eps)}
    if not group["use_muon"]:
        for key in _MUON_ONLY:
            group.pop(key, None)
        group.update(adamw)


def _build(make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
           groups: list[dict[str, Any]]) -> torch.optim.Optimizer | None:
    """The optimizer over ``groups``, or ``None`` without groups (a group may be empty: a ZeRO
    rank that owns none of its tensors)."""
    return make(groups) if groups else None

