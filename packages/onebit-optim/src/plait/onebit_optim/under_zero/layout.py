"""The layout the ZeRO forms of the 1-bit optimizers share: a unit's exchange state, the server
chunk of a shard, the bytes of a compressed step, the conversion between the exchange layout
(``world`` chunks of a shard and its padding to whole sign bytes) and the unit's logical elements,
and the base of the inner optimizers over the fp32 master shards.
"""

from __future__ import annotations

from typing import Any

import torch


class UnitState:
    """One unit's exchange layout and error feedback (chunk ``r`` of ``cp`` elements holds shard ``r``)."""

    def __init__(self, unit: Any) -> None:
        self.unit = unit
        self.world, self.rank, self.shard = unit.group_size, unit.group_rank, unit.shard_numel
        self.chunk = chunk_of(self.shard)
        device = unit.device
        self.worker_error = torch.zeros(self.world * self.chunk, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        self.signs: torch.Tensor | None = None  # all-gathered server signs: the synchronised momentum in 1 bit
        self.scales: torch.Tensor | None = None
        self.factors: list[float] = []
        self.momentum: torch.Tensor | None = None  # this step's averaged momentum shard, for the inner step
        # Scratch buffers kept from step to step (name -> flat fp32, zero where never written): a new
        # tensor of the unit's size every step costs fresh pages, more than the arithmetic on it.
        self.scratch: dict[str, torch.Tensor] = {}

    def scratch_buffer(self, name: str, numel: int) -> torch.Tensor:
        """The unit's scratch buffer ``name`` of ``numel`` fp32 elements, zeros when first made; the
        caller overwrites what it uses and leaves the rest as it was (its padding stays zero)."""
        buffer = self.scratch.get(name)
        if buffer is None or buffer.numel() != numel:
            buffer = self.scratch[name] = torch.zeros(numel, dtype=torch.float32, device=self.unit.device)
        return buffer


def chunk_of(shard: int) -> int:
    """Server chunk size for a ZeRO shard of ``shard`` elements: rounded up to whole sign bytes."""
    return -(-shard // 8) * 8


def exchange_nbytes(unit_numels: list[tuple[int, int]], world: int) -> int:
    """Logical bytes one compressed step's exchanges record per rank, from ``(shard_numel, tensors)``
    per unit: all-to-all and all-gather of signs (``W x chunk / 8`` each), the two scale
    all-gathers (``4 W`` each) and the per-tensor RMS all-reduce (``4 x tensors``)."""
    total = 0
    for shard, tensors in unit_numels:
        n = world * chunk_of(shard)
        total += 2 * (n // 8) + 2 * 4 * world + 4 * tensors
    return total


def to_logical(exchange_layout: torch.Tensor, world: int, shard: int, numel: int) -> torch.Tensor:
    """Exchange-layout values (``world`` chunks, each a shard and padding) as the unit's ``numel``
    elements."""
    chunk = chunk_of(shard)
    return exchange_layout.view(world, chunk)[:, :shard].reshape(-1)[:numel]


def from_logical(values: torch.Tensor, state: UnitState) -> torch.Tensor:
    """The unit's logical values (:func:`to_logical`'s output) back in ``state``'s exchange layout, zero-padded."""
    flat = torch.zeros(state.world * state.shard, device=values.device)
    flat[:values.numel()] = values
    out = torch.zeros(state.world, state.chunk, device=values.device)
    out[:, :state.shard] = flat.view(state.world, state.shard)
    return out.view(-1)


class ShardedInner(torch.optim.Optimizer):
    """Base of the inner optimizers ``zero_shard`` builds over the fp32 master shards for the three
    1-bit optimizers (through :func:`plait.onebit_optim.under_zero.compose.compose_with_zero`, which
    sets ``EXCHANGE``, the reducer they cooperate with); not meant to be built by hand.
    """

    EXCHANGE: Any  # the OnebitZeroExchange (or ZeroOneZeroExchange) built for this optimizer

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.exchange = self.EXCHANGE
        self.exchange.optimizer = self
        self.config = self.exchange.config
