"""Single-process tests of the layers below the engine: flat layout and padding, partitioning
(module groups, tied weights, resident small parameters), the loss-scale state machine, the
memory formula against the ZeRO paper's worked example."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.kernels.testing import tiny_llama
from plait.zero_sharding.config import ZeroConfig
from plait.zero_sharding.loss_scaler import LossScaler
from plait.zero_sharding.memory import zero_formula_bytes
from plait.zero_sharding.partition import OptionGroup, build_partition, root_modules, unit_modules
from plait.zero_sharding.units import FlatUnit, ParamSlot

MODEL = dict(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=48, vocab_size=50, max_seq_len=16)


def _unit(sizes: list[int], rank: int, world: int, *, resident: bool) -> FlatUnit:
    slots, offset = [], 0
    for index, size in enumerate(sizes):
        slots.append(ParamSlot(f"p{index}", nn.Parameter(torch.arange(size, dtype=torch.float32) + 100 * index),
                               offset, size, (size,)))
        offset += size
    unit = FlatUnit(key="u0", slots=slots, group=None, group_rank=rank, group_size=world, resident=resident,
                    compute_dtype=torch.float32, reduce_dtype=torch.float32, option_index=0, replicas=1,
                    device=torch.device("cpu"))
    unit.build(None, mixed=False, stage=3)
    return unit


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_flat_layout_pads_at_the_end_and_covers_every_element_once(world: int) -> None:
    sizes = [5, 7, 1]
    covered = torch.zeros(sum(sizes), dtype=torch.int64)
    for rank in range(world):
        unit = _unit(sizes, rank, world, resident=False)
        assert unit.padded_numel % world == 0 and 0 <= unit.padded_numel - unit.numel < world
        for slot, (plo, phi), (slo, shi) in unit.local_pieces():
            assert phi > plo and shi - slo == phi - plo  # never an empty piece
            expected = torch.arange(slot.numel) + 100 * int(slot.name[1:])
            assert torch.equal(unit.master[slo:shi], expected[plo:phi].float())
            covered[slot.offset + plo:slot.offset + phi] += 1
    assert torch.equal(covered, torch.ones_like(covered))


@pytest.mark.parametrize("owned", [False, True])
def test_one_rank_master_adopts_an_owned_value_without_a_view(owned: bool) -> None:
    """On one rank a one-parameter unit's master is exactly the parameter's value: an owned value
    (released by sharded construction) becomes the master with no copy, and not as a view, whose
    base would keep the memory alive after the shard is swapped for a placeholder."""
    value = torch.arange(12, dtype=torch.float32).view(3, 4)
    slot = ParamSlot("w", nn.Parameter(torch.empty(0)), 0, 12, (3, 4))
    unit = FlatUnit(key="u0", slots=[slot], group=None, group_rank=0, group_size=1, resident=False,
                    compute_dtype=torch.float32, reduce_dtype=torch.float32, option_index=0, replicas=1,
                    device=torch.device("cpu"))
    unit.build({"w": value}, mixed=False, stage=3, owned=owned)
    assert torch.equal(unit.master, value.reshape(-1)) and unit.shard is unit.master
    assert (unit.master.data_ptr() == value.data_ptr()) is owned  # shared only when owned
    assert not unit.master._is_view() and unit.full.untyped_storage().nbytes() == 0


def test_sharded_unit_frees_storage_and_views_survive_gather() -> None:
    unit = _unit([6, 2], 0, 1, resident=False)
    assert unit.full.untyped_storage().nbytes() == 0 and not unit.gathered
    view = unit.slots[1].param

    class Local:  # a world-of-one gatherer: copy the shard
        def all_gather(self, shard: torch.Tensor, full_out: torch.Tensor, *, group: object, key: str,
                       phase: str) -> None:
            full_out.copy_(shard)

    unit.gather(Local(), "forward")
    assert torch.equal(view.detach(), torch.tensor([100.0, 101.0]))
    unit.release()
    assert unit.full.untyped_storage().nbytes() == 0
    assert view.shape == (2,)  # the view keeps its metadata while its storage is freed


def test_partition_groups_modules_ties_to_root_and_keeps_small_parameters_resident() -> None:
    torch.manual_seed(0)
    model = tiny_llama(**MODEL)
    model.lm_head.weight = model.embed_tokens.weight  # tied across the root's modules
    blocks = unit_modules(model, ZeroConfig(stage=3))
    assert blocks == list(model.layers)
    params = list(model.parameters())
    group = OptionGroup(options={}, params=params, group=None, group_rank=0, group_size=1, replicas=1)
    partition = build_partition(model, ZeroConfig(stage=3, param_persistence_threshold=40), [group], None,
                                torch.device("cpu"))
    names = {u.key: [s.name for s in u.slots] for u in partition.units}
    root = [s.name for u in partition.root_units for s in u.slots]
    assert "embed_tokens.weight" in root and "lm_head.weight" not in sum(names.values(), [])  # tied: once
    for block, units in partition.module_units.items():
        assert all(s.name.startswith(f"layers.{list(model.layers).index(block)}.") for u in units for s in u.slots)
    resident = [s.name for u in partition.units if u.resident for s in u.slots]
    assert resident and all("norm" in name for name in resident)  # 32-element norms < 40
    assert sorted(sum(names.values(), [])) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_separate_root_gives_embedding_and_head_units_and_keeps_ties_in_the_root(tied: bool) -> None:
    torch.manual_seed(0)
    model = tiny_llama(**MODEL)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight  # used by two modules: stays in the root
    assert root_modules(model, list(model.layers)) == [model.embed_tokens, model.norm, model.lm_head]
    group = OptionGroup(options={}, params=list(model.parameters()), group=None, group_rank=0, group_size=1,
                        replicas=1)
    partition = build_partition(model, ZeroConfig(stage=3, param_persistence_threshold=0), [group], None,
                                torch.device("cpu"), separate_root=True)
    own = {module: [s.name for u in units for s in u.slots] for module, units in partition.module_units.items()}
    root = [s.name for u in partition.root_units for s in u.slots]
    assert own[model.norm] == ["norm.weight"]
    if tied:
        assert root == ["embed_tokens.weight"] and model.embed_tokens not in own and model.lm_head not in own
    else:
        assert root == [] and own[model.embed_tokens] == ["embed_tokens.weight"]
        assert own[model.lm_head] == ["lm_head.weight"]
    every = [s.name for u in partition.units for s in u.slots]
    assert sorted(every) == sorted(n for n, _ in model.named_parameters())  # each parameter once


def test_stage12_buckets_respect_the_bucket_size() -> None:
    model = tiny_llama(**MODEL)
    group = OptionGroup(options={}, params=list(model.parameters()), group=None, group_rank=0, group_size=1,
                        replicas=1)
    partition = build_partition(model, ZeroConfig(stage=2, reduce_bucket_elements=2000), [group], None,
                                torch.device("cpu"))
    for unit in partition.units:
        assert unit.resident and (unit.numel <= 2000 or len(unit.slots) == 1)
    assert partition.units[0].slots[0].name == "lm_head.weight"  # reverse order: backward produces it first


def test_loss_scaler_backoff_hysteresis_growth_and_minimum() -> None:
    scaler = LossScaler(ZeroConfig(compute_dtype="fp16", initial_scale_power=3, hysteresis=2, loss_scale_window=2,
                                   min_loss_scale=2.0), enabled=True)
    history = []
    for overflow in (True, True, True, False, False, True, True, True, True):
        scaler.update(overflow)
        history.append(scaler.scale)
    # hysteresis 2: the first overflow is tolerated, the second backs off; growth resets it.
    assert history == [8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 2.0, 2.0, 2.0]
    assert scaler.skipped_steps == 7
    restored = LossScaler(ZeroConfig(compute_dtype="fp16"), enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    assert LossScaler(ZeroConfig(), enabled=False).scale == 1.0


def test_memory_formula_matches_the_paper_example() -> None:
    # ZeRO paper, Figure 1: Psi = 7.5B, N = 64, K = 12 (fp16 params/grads, Adam): 120 / 31.4 / 16.6 / 1.9 GB.
    psi, n = 7.5e9, 64

    def gb(stage: int) -> float:
        return zero_formula_bytes(int(psi), stage=stage, world_size=n, compute_dtype=torch.float16,
                                  grad_dtype=torch.float16, optimizer_state_bytes=8) / 1e9

    assert (round(gb(1), 1), round(gb(2), 1), round(gb(3), 1)) == (31.4, 16.6, 1.9)
    assert zero_formula_bytes(100, stage=3, world_size=1, compute_dtype=torch.float16, grad_dtype=torch.float16,
                              optimizer_state_bytes=8) == 16 * 100  # baseline (2 + 2 + K) Psi
