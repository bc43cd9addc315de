"""``model.state_dict()`` of a model whose experts differ across ranks: W=4, dp=2 x ep=2 (ranks
with the same position in their ep pair hold the same experts, sharded over that expert-data-
parallel pair), experts stored stacked and given a global identity by ``zero_global``.

The dict is the whole model on every rank (every expert, global names and shapes), equal to a
single-process reference that ran the same steps, equal to the export, and ``load_state_dict``
takes it back into a fresh sharded model whose ranks keep their own rows. Identities that collide
are refused naming the tensor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from test_zero_sharding_composition import _routed_batch
from test_zero_sharding_identity import LOCAL_EXPERTS, Stacked, _read_safetensors, _stacked_uses

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

WORLD, EP, STEPS = 4, 2, 2


def _ep_rank(rank: int) -> int:
    return rank % EP


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, every expert: rank r's batch runs global experts ``ep_rank(r) * L + e`` for
    its local ``e``; loss averaged over the 4 ranks; SGD(lr=0.5)."""
    torch.manual_seed(0)
    model = Stacked(LOCAL_EXPERTS * EP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        loss = sum(model(_routed_batch(step, r)[0],
                         [_ep_rank(r) * LOCAL_EXPERTS + e for e in _stacked_uses(step, r)]) for r in range(WORLD))
        (loss / WORLD).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _expert_data_parallel_group() -> object:
    """Ranks holding the same experts: ``{0, 2}`` and ``{1, 3}`` (every rank creates both)."""
    groups = [dist.new_group(list(range(offset, WORLD, EP))) for offset in range(EP)]
    return groups[_ep_rank(dist.get_rank())]


def _sharded(stage: int, *, colliding: bool = False) -> tuple:
    """This rank's part of ``Stacked(L * ep)``: the dense trunk and rows ``[ep_rank * L, (ep_rank
    + 1) * L)`` of each stacked expert weight, those sharded over the expert-data-parallel pair."""
    first = _ep_rank(dist.get_rank()) * LOCAL_EXPERTS
    edp = _expert_data_parallel_group()
    torch.manual_seed(0)
    whole = Stacked(LOCAL_EXPERTS * EP)
    model = Stacked(LOCAL_EXPERTS)
    rows = slice(first, first + LOCAL_EXPERTS)
    model.load_state_dict({k: v[rows] if k.startswith("experts.") else v for k, v in whole.state_dict().items()})
    experts = list(model.experts.parameters())
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]

    def global_of(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
        return name, (shape[0] * EP, *shape[1:]), 0 if colliding else first

    return zero_shard(model, torch.optim.SGD, ZeroConfig(stage=stage, param_persistence_threshold=0), lr=0.5,
                      param_groups=[{"params": dense},
                                    {"params": experts, "zero_group": edp, "zero_global": global_of}])


def _train_save_reload(tmp: str, stage: int) -> dict:
    rank = dist.get_rank()
    model, optimizer = _sharded(stage)
    for step in range(STEPS):
        model(_routed_batch(step, rank)[0], _stacked_uses(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    path = Path(tmp) / f"ep{stage}.safetensors"
    model.export_full_weights(path)
    dist.barrier()
    exported = _read_safetensors(path)
    fresh, fresh_optimizer = _sharded(stage)
    loaded = fresh.load_state_dict(state)
    first = _ep_rank(rank) * LOCAL_EXPERTS
    with fresh.gathered_parameters():  # the live local parameters must be this rank's rows
        own = max((p - state[f"experts.{n}"][first:first + LOCAL_EXPERTS]).abs().max().item()
                  for n, p in fresh.experts.named_parameters())
    # Training goes on from the loaded state exactly as from the original.
    for model_, optimizer_ in ((model, optimizer), (fresh, fresh_optimizer)):
        model_(_routed_batch(STEPS, rank)[0], _stacked_uses(STEPS, rank)).backward()
        optimizer_.step()
        optimizer_.zero_grad()
    after, fresh_after = model.state_dict(), fresh.state_dict()
    return {"state": state, "keys": list(state), "exported": max((state[k] - exported[k]).abs().max().item()
                                                                for k in exported),
            "exported_keys": sorted(exported), "missing": loaded.missing_keys, "unexpected": loaded.unexpected_keys,
            "reloaded": max((fresh_after[k] - after[k]).abs().max().item() for k in after), "own": own}


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_state_dict_is_the_whole_model_with_global_names_at_ep2(tmp_path, stage):
    expected = reference(STEPS)
    results = run_distributed(_train_save_reload, WORLD, str(tmp_path), stage, timeout=150)
    for rank, result in enumerate(results):
        state = result["state"]
        assert sorted(state) == sorted(expected), rank  # global names only, every expert
        for name, value in expected.items():
            assert state[name].shape == value.shape, (rank, name)
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
            assert torch.equal(state[name], results[0]["state"][name])  # the same dict on every rank
        assert result["exported_keys"] == sorted(expected) and result["exported"] == 0.0
        assert result["missing"] == [] and result["unexpected"] == []
        assert result["own"] == 0.0
        assert result["reloaded"] == 0.0


def _colliding_identity() -> str:
    model, _ = _sharded(2, colliding=True)
    with pytest.raises(ValueError, match=r"state_dict: several ranks hold \['experts.w_in'") as info:
        model.state_dict()
    return str(info.value)


def test_colliding_global_identities_are_refused_on_every_rank():
    for message in run_distributed(_colliding_identity, WORLD, timeout=90):
        assert "zero_global" in message


def _without_identity() -> dict:
    """Each rank's own expert in a group of one, without ``zero_global``: every rank's expert is
    called ``experts.0``."""
    from test_zero_sharding_composition import _expert_parallel_model

    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    model = _expert_parallel_model(world, rank)
    experts = list(model.experts.parameters())
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    model, _ = zero_shard(model, torch.optim.SGD, ZeroConfig(stage=3, param_persistence_threshold=0), lr=0.5,
                          param_groups=[{"params": dense}, {"params": experts, "zero_group": singles[rank]}])
    with pytest.raises(ValueError, match=r"sharded_state_dict: several ranks hold \['experts.0.0.bias'") as info:
        model.sharded_state_dict()  # a checkpoint would keep one rank's expert for both
    state = model.state_dict()
    with model.gathered_parameters():
        own = model.experts[0][0].weight.detach().clone()
    return {"message": str(info.value), "own": torch.equal(state["experts.0.0.weight"], own),
            "experts": sorted(k for k in state if k.startswith("experts."))}


def test_differing_parameters_without_identity_stay_rank_local_and_are_not_checkpointed():
    results = run_distributed(_without_identity, 2, timeout=90)
    for result in results:
        assert "zero_global" in result["message"]
        assert result["own"]  # state_dict(): this rank's own expert, under its local name
        assert result["experts"] == sorted(f"experts.0.{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
