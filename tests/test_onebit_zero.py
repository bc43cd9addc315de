"""plait-onebit-optim with plait-zero-sharding: the 1-bit optimizers exchange their own compressed
momentum over the whole model, which ZeRO sharding does not compose with yet; zero_shard refuses
them at every stage with a message that says what works instead, before any process group or
allocation, even with ``elementwise_optimizer=True``."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

from plait.onebit_optim import Lamb, OnebitAdam, OnebitLamb, ZeroOneAdam
from plait.zero_sharding import ZeroConfig, zero_shard


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", [OnebitAdam, OnebitLamb, ZeroOneAdam])
def test_one_bit_optimizers_are_refused_by_zero_naming_what_works(optimizer: type, stage: int) -> None:
    for elementwise in (None, True):
        with pytest.raises(ValueError, match=rf"{optimizer.__name__} exchanges its own compressed momentum.*"
                                             "plain, unwrapped model"):
            zero_shard(nn.Linear(4, 4), optimizer, ZeroConfig(stage=stage, elementwise_optimizer=elementwise),
                       lr=1e-3)
    assert not dist.is_initialized()


def test_plain_lamb_is_refused_as_not_elementwise() -> None:
    with pytest.raises(ValueError, match="Lamb is not known to be elementwise"):
        zero_shard(nn.Linear(4, 4), Lamb, ZeroConfig(stage=2), lr=1e-3)
