"""1-bit Adam's inner optimizer under ZeRO-1/2, over the fp32 master shards: torch's AdamW kernel
during warm-up, then the frozen-variance update with the averaged momentum shard the exchange
(:mod:`plait.onebit_optim.under_zero.exchange`) hands it. Built by
:func:`plait.onebit_optim.under_zero.compose.compose_with_zero`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.onebit_optim.data_parallel.base import run_closure
from plait.onebit_optim.rules.adam import adam_state, adamw_step, frozen_variance_update
from plait.onebit_optim.under_zero.layout import ShardedInner
from plait.onebit_optim.under_zero.variance_floor import floor_shard_


class ShardedOnebitAdam(ShardedInner):
    """The inner optimizer of 1-bit Adam under ZeRO, over the fp32 master shards.

    Warm-up: torch's AdamW kernel on the averaged gradient shards. After it: the averaged
    momentum shard from :class:`OnebitZeroExchange` and the frozen variance (with
    ``zero_param_sync="update"``, every other shard of the replica too:
    :mod:`plait.onebit_optim.under_zero.replicated_update`). ``zero_shard``
    builds it (through :func:`compose_with_zero`); it is not meant to be built by hand.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of the master shards (see the class docstring)."""
        loss = run_closure(closure)
        self.exchange.run_deferred()  # clipping / fp16: the units are exchanged now
        keys = {id(m): k for k, m in self.exchange.engine.placement.masters().items()} if self.exchange.engine else {}
        compressed = self.exchange.compressing and any(
            self.exchange.take_momentum(k) is not None for k in keys.values())
        for group in self.param_groups:
            if compressed:
                self._compressed_step(group, keys)
            else:
                self._adamw_step(group)
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        return adam_state(self.state[p], p)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        adamw_step(self.state, [p for p in group["params"] if p.grad is not None], group)

    def _compressed_step(self, group: dict[str, Any], keys: dict[int, str]) -> None:
        for p in group["params"]:
            momentum = self.exchange.take_momentum(keys.get(id(p), ""))
            if momentum is None:
                continue
            state = self._state(p)
            if int(self.exchange.steps[0]) == self.exchange.freeze_step:  # the variance freezes now
                unit = self.exchange.units[keys[id(p)]].unit
                floor_shard_(unit, state["exp_avg_sq"], self.config.variance_floor, name="OnebitAdam")
            state["exp_avg"].copy_(momentum)
            step_before = state["step"].clone()
            # zero_param_sync="update": the other shards of the replica too, instead of the gather, and
            # the frozen denominator is kept whole (this shard's piece of it is this shard's own).
            update_others = getattr(self.exchange, "update_other_shards", None)
            denom = None
            if update_others is not None:
                unit = self.exchange.units[keys[id(p)]].unit
                lo = unit.group_rank * unit.shard_numel
                denom = self.exchange.denominator(keys[id(p)], group, state)[lo:lo + unit.shard_numel]
            frozen_variance_update(p, state, group, self.exchange.freeze_step, denom=denom)
            if update_others is not None:
                update_others(keys[id(p)], step_before, group, state)
