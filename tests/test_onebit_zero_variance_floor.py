"""plait-onebit-optim with plait-zero-sharding: the variance floor under ZeRO stages 1 and 2.

A 2048-token LM (embedding, one mixing layer, head) on random tokens: before the variance freezes
most embedding rows were never seen, so their frozen variance is ~0 and the published algorithms
step them by ``|m| / eps`` (1-bit Adam with ``freeze_step=2``, 0/1 Adam with a 3-step variance
phase) or let them take most of their tensor's step (1-bit LAMB). Under ZeRO each tensor's mean
variance is summed across the shards of its flat unit (one all-reduce of ``8 x tensors`` bytes
per unit), so with the default floors ZeRO-2 at W=2 and W=4 trains like the data-parallel
optimizer with the floor, grouped by ZeRO unit (its reference): losses within 1e-3, as the other
ZeRO-vs-plain tests; at W=2 the floors themselves are equal to the last bit (both sum in
float64). The floor's all-reduce is counted in bytes against its formula.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import run_distributed
from plait.onebit_optim import (
    OnebitAdam,
    OnebitAdamConfig,
    OnebitLamb,
    OnebitLambConfig,
    ZeroOneAdam,
    ZeroOneAdamConfig,
)
from plait.onebit_optim.rules.variance_floor import variance_floor
from plait.onebit_optim.under_zero.adam01 import VARIANCE, zero_one_step_nbytes
from plait.onebit_optim.under_zero.variance_floor import floor_nbytes, tensor_means
from plait.zero_sharding import ZeroConfig, zero_shard

VOCAB, DIM, SEQ, BATCH, STEPS, LR = 2048, 32, 16, 4, 12, 3e-4
BUCKET = 40_000  # the head and the embedding in units of their own, split over the shards
OPTIMIZERS = {
    "OnebitAdam": (OnebitAdam, OnebitAdamConfig(freeze_step=2)),
    "ZeroOneAdam": (ZeroOneAdam, ZeroOneAdamConfig(var_freeze_step=3, var_update_scaler=3, local_step_scaler=1,
                                                   local_step_clipper=4)),
    "OnebitLamb": (OnebitLamb, OnebitLambConfig(freeze_step=2)),
}


class WideVocabLM(nn.Module):
    """Embedding, a causal running-mean mixing layer, and a head over a 2048-token vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        running_mean = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        return self.head(h + torch.tanh(self.mix(running_mean)))


def _train(model: nn.Module, optimizer, steps: int, start: int = 0) -> list[float]:
    """This rank's slice of the same global batch per step; returns the global mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        ids = ids[rank * BATCH // world:(rank + 1) * BATCH // world]
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report = loss.detach().clone()
        dist.all_reduce(report)
        losses.append(report.item() / world)
    return losses


def _against_plain(name: str) -> tuple[list[float], list[float], int, int]:
    """ZeRO-2 with the default floor against plain data parallel grouped by ZeRO unit; the bytes
    of the first step (0/1 Adam: a variance step, with the floor's all-reduce) and its formula."""
    cls, config = OPTIMIZERS[name]
    model, opt = zero_shard(WideVocabLM(), cls, ZeroConfig(stage=2, reduce_bucket_elements=BUCKET), lr=LR,
                            onebit_config=config)
    units = model.zero_engine.units
    with ByteLedger() as ledger:
        zero_losses = _train(model, opt, 1)
    world = dist.get_world_size()
    layout = [(unit.numel, unit.shard_numel, len(unit.slots)) for unit in units]
    formula = zero_one_step_nbytes(layout, world, VARIANCE, variance_floor=True) if name == "ZeroOneAdam" else -1
    zero_losses += _train(model, opt, STEPS - 1, start=1)
    plain = WideVocabLM()
    named = dict(plain.named_parameters())
    groups = [{"params": [named[slot.name] for slot in unit.slots]} for unit in units]
    plain_losses = _train(plain, cls(groups, lr=LR, config=config), STEPS)
    return zero_losses, plain_losses, ledger.total() if name == "ZeroOneAdam" else -1, formula


def _floor_means() -> list[tuple[int, int, bool]]:
    """Per unit: the bytes of :func:`tensor_means` against :func:`floor_nbytes`, and whether the
    floors from the shards equal the data-parallel floor of each whole tensor to the last bit."""
    model, _ = zero_shard(WideVocabLM(), OnebitAdam, ZeroConfig(stage=2, reduce_bucket_elements=BUCKET), lr=LR)
    reference = WideVocabLM()
    named = dict(reference.named_parameters())
    out = []
    for unit, master in zip(model.zero_engine.units, model.zero_engine.placement.masters().values()):
        squares = master.detach().square()  # a variance-like, non-negative shard
        with ByteLedger() as ledger:
            means = tensor_means(unit, squares, name="test")
        same = all(
            torch.tensor(float(means[i]) * 0.001, dtype=torch.float32)
            == variance_floor(named[slot.name].detach().square(), 0.001)
            for i, slot in enumerate(unit.slots))
        out.append((ledger.total(), floor_nbytes(len(unit.slots)), same))
    return out


def _all() -> tuple[dict[str, tuple[list[float], list[float], int, int]], list[tuple[int, int, bool]]]:
    """Every optimizer against its reference, and the floor means (one set of processes: spawning
    them costs more than the runs)."""
    return {name: _against_plain(name) for name in OPTIMIZERS}, _floor_means()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_zero_with_the_floor_trains_like_plain_data_parallel_with_it(world: int) -> None:
    runs, floor_means = run_distributed(_all, world, timeout=280)[0]
    for name, (zero_losses, plain_losses, recorded, formula) in runs.items():
        assert all(math.isfinite(x) and x < 9 for x in zero_losses), (name, zero_losses)  # log(2048) = 7.6
        assert max(abs(a - b) for a, b in zip(zero_losses, plain_losses)) < 1e-3, (name, zero_losses, plain_losses)
        assert recorded == formula, name
    assert len(floor_means) >= 2
    for recorded, formula, same in floor_means:
        assert recorded == formula and same
