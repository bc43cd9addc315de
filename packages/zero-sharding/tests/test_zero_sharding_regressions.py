"""Regressions found by the packages built on zero-sharding (Lightning, universal-ckpt, ZeRO++)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import OPT, build_model

from plait.zero_sharding import ZeroConfig, gathered_parameters, zero_shard
from plait.zero_sharding.zeropp import QuantizedParamGatherer


def _optimizer_instance_matches_class() -> bool:
    # torch's AdamW keeps derived keys (decoupled_weight_decay) in .defaults that its
    # constructor refuses; an instance must still be accepted.
    by_instance = build_model()
    by_instance, opt_a = zero_shard(by_instance, torch.optim.AdamW(by_instance.parameters(), **OPT),
                                    ZeroConfig(stage=2))
    by_class, opt_b = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=2), **OPT)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for model, opt in ((by_instance, opt_a), (by_class, opt_b)):
        model(ids, labels=ids).loss.backward()
        opt.step()
    assert opt_a.param_groups[0]["weight_decay"] == OPT["weight_decay"]
    return all(torch.equal(a, b) for a, b in zip(by_instance.state_dict().values(), by_class.state_dict().values()))


def _step_counter_holders() -> list[tuple[int, ...]]:
    model, opt = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=3, param_persistence_threshold=0),
                            **OPT)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids, labels=ids).loss.backward()
    opt.step()
    state = model.sharded_state_dict()
    return sorted({st.spec.replica_ranks for name, st in state.items() if name.startswith("optim.step.")})


def _gathered_writeback_keeps_masters_exact() -> bool:
    model, opt = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=3, param_persistence_threshold=0),
                            gatherer=QuantizedParamGatherer(bits=8), **OPT)
    before = [p.detach().clone() for p in opt.inner.param_groups[0]["params"]]
    with gathered_parameters(model, writeback=True):
        pass  # nothing edited: the fp32 masters must not pick up int8 rounding
    after = opt.inner.param_groups[0]["params"]
    return all(torch.equal(a, b) for a, b in zip(before, after))


def test_optimizer_instance_with_derived_defaults():
    from plait.kernels.testing import run_distributed

    assert run_distributed(_optimizer_instance_matches_class, 1, timeout=90) == [True]


@pytest.mark.parametrize("world", [2])
def test_split_parameters_name_every_holder_of_their_step_counter(world):
    from plait.kernels.testing import run_distributed

    for holders in run_distributed(_step_counter_holders, world, timeout=90):
        # parameters split across both ranks share one counter that both ranks hold
        assert (0, 1) in holders


def test_gathered_writeback_is_exact_under_quantized_gathers():
    from plait.kernels.testing import run_distributed

    assert run_distributed(_gathered_writeback_keeps_masters_exact, 2, timeout=90) == [True, True]
