"""UlyssesConfig validation, the head plan's refusals, and sequence sharding arithmetic (one process)."""

from __future__ import annotations

import pytest
import torch

from plait.ulysses_sp import HeadLayout, SPGroup, UlyssesConfig, shard_sequence, shift_labels
from plait.ulysses_sp.sharding import padded_length


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"sp_dim": ""}, "sp_dim"),
    ({"inner_attention": "flash_attention_2"}, "inner_attention"),
    ({"tiled_mlp_chunks": 0}, "tiled_mlp_chunks"),
    ({"tiled_mlp_chunks": True}, "tiled_mlp_chunks"),
    ({"fpdt_chunk": 0}, "fpdt_chunk"),
])
def test_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"UlyssesConfig.{field}"):
        UlyssesConfig(**kwargs)


def test_config_is_frozen_and_keyword_only():
    config = UlyssesConfig(tiled_mlp_chunks=4)
    with pytest.raises(AttributeError):
        config.sp_dim = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        UlyssesConfig("sp")  # type: ignore[misc]


def test_head_layout_refuses_fewer_heads_than_ranks_and_bad_gqa():
    with pytest.raises(ValueError, match="smaller than sp=4"):
        HeadLayout.build(sp=4, q_heads=2, kv_heads=2)
    with pytest.raises(ValueError, match="divide num_attention_heads"):
        HeadLayout.build(sp=2, q_heads=6, kv_heads=4)


def test_gqa_layout_sends_each_rank_only_the_kv_heads_it_reads():
    layout = HeadLayout.build(sp=4, q_heads=8, kv_heads=2)  # groups of 4 query heads
    assert layout.q_splits == (2, 2, 2, 2)
    assert layout.kv_index == ((0,), (0,), (1,), (1,))
    assert layout.kv_local == ((0, 0), (0, 0), (0, 0), (0, 0))
    uneven = HeadLayout.build(sp=4, q_heads=6, kv_heads=3)  # 2, 2, 1, 1 query heads; groups of 2
    assert uneven.kv_index == ((0,), (1,), (2,), (2,))


def test_shard_sequence_pads_to_a_multiple_and_slices_in_rank_order():
    x = torch.arange(10).view(1, 10)
    parts = [shard_sequence(x, SPGroup(group=None, rank=r, size=4), pad_value=-1) for r in range(4)]
    assert torch.cat(parts, 1).tolist() == [list(range(10)) + [-1, -1]]
    assert padded_length(8, 4) == 8
    with pytest.raises(ValueError, match="shorter than sp=4"):
        padded_length(3, 4)


def test_shift_labels_moves_targets_left_and_ignores_the_last():
    assert shift_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, -100]]


def _loader_on_dp2_sp2() -> dict:
    from torch.utils.data import DataLoader, DistributedSampler

    from plait.kernels.mesh import make_mesh
    from plait.ulysses_sp import SequenceParallelLoader, dp_coordinates, gather_sequence

    mesh = make_mesh(dp=2, sp=2)
    dp_rank, dp_size = dp_coordinates(mesh)
    data = [{"input_ids": torch.arange(i * 100, i * 100 + 7), "labels": torch.arange(i * 100, i * 100 + 7)}
            for i in range(4)]
    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    loader = SequenceParallelLoader(DataLoader(data, sampler=sampler, batch_size=2), mesh)
    batches = list(loader)
    whole = gather_sequence(batches[0]["input_ids"], mesh, seq_len=7)
    return {"dp_rank": dp_rank, "len": len(loader), "ids": batches[0]["input_ids"].tolist(),
            "positions": batches[0]["position_ids"].tolist(), "labels": batches[0]["shift_labels"].tolist(),
            "whole": whole.tolist()}


def test_loader_gives_an_sp_group_one_batch_and_each_rank_its_slice():
    from plait.kernels.testing.distributed import run_distributed

    out = run_distributed(_loader_on_dp2_sp2, 4, timeout=60)
    # ranks 0,1 are dp rank 0 (samples 0 and 2), ranks 2,3 are dp rank 1 (samples 1 and 3)
    assert [o["dp_rank"] for o in out] == [0, 0, 1, 1] and all(o["len"] == 1 for o in out)
    assert out[0]["whole"] == out[1]["whole"] == [list(range(0, 7)), list(range(200, 207))]
    assert out[2]["whole"] == [list(range(100, 107)), list(range(300, 307))]
    assert out[0]["ids"][0] == [0, 1, 2, 3] and out[1]["ids"][0] == [4, 5, 6, 0]  # padded to 8 with id 0
    assert out[1]["positions"][0] == [4, 5, 6, 7]
    assert out[0]["labels"][0] == [1, 2, 3, 4] and out[1]["labels"][0] == [5, 6, -100, -100]
