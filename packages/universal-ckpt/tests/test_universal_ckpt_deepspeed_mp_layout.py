"""DeepSpeed model-parallel import on checkpoints built here from the documented 0.19.8 layout.

No deepspeed needed: the files are plain ``torch.save`` dicts with the fields DeepSpeed writes
(``param_shapes``, ``mp_world_size``, ``checkpoint_parallel_dimensions``,
``universal_checkpoint_info`` with its ``affine_map``; ZeRO-1 partitions of the flat fp32 group).
They cover what the DeepSpeed-written fixtures here cannot: a fused ``gate_up_proj`` whose rank
shard is two pieces (``[gate_r | up_r]``), a padded vocabulary described only by the regex lists,
``parameter_with_2_sub_params_cat_dim_0``, averaged tensors, drifted replicas and broken maps.
"""

from __future__ import annotations

import math

import pytest
import torch

import plait.universal_ckpt as uc
from plait.universal_ckpt.interop import deepspeed_mp
from plait.universal_ckpt.interop.deepspeed import import_deepspeed

TP = 2


def _piece(shape, source_offset, source_strides, dest_offset, dest_strides, locations):
    return {"shape": list(shape), "source": [source_offset, list(source_strides)],
            "dest": [dest_offset, list(dest_strides)], "locations": list(locations)}


def _fused_gate_up_map(inter: int, hidden: int) -> dict:
    """[gate | up] rows, each split over TP separately: rank r holds [gate_r | up_r]."""
    rows = inter // TP
    ranks = {}
    for r in range(TP):
        ranks[r] = {"shard_shape": [2 * rows, hidden], "pieces": [
            _piece((rows, hidden), r * rows * hidden, (hidden, 1), 0, (hidden, 1), [r]),
            _piece((rows, hidden), (inter + r * rows) * hidden, (hidden, 1), rows * hidden, (hidden, 1), [r])]}
    return {"logical_shape": [2 * inter, hidden], "ranks": ranks}


def _replicated_map(shape) -> dict:
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return {"logical_shape": list(shape), "ranks": {r: {"shard_shape": list(shape), "pieces": [
        _piece(shape, 0, strides, 0, strides, range(TP))]} for r in range(TP)}}


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"mlp.gate_up_proj.weight": torch.randn(12, 4, generator=g), "norm.weight": torch.randn(4, generator=g),
            "embed.weight": torch.randn(5, 4, generator=g), "proj.weight": torch.randn(4, 6, generator=g),
            "swiglu.weight": torch.randn(8, 4, generator=g)}


def _shards(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """This rank's pieces, sliced by hand (the oracle)."""
    gate, up = full["mlp.gate_up_proj.weight"].chunk(2)
    embed = torch.cat([full["embed.weight"], torch.zeros(1, 4)])  # vocabulary 5 padded to 6
    sw0, sw1 = full["swiglu.weight"].chunk(2)
    return {"mlp.gate_up_proj.weight": torch.cat([gate.chunk(TP)[rank], up.chunk(TP)[rank]]),
            "norm.weight": full["norm.weight"], "embed.weight": embed.chunk(TP)[rank],
            "proj.weight": full["proj.weight"].chunk(TP, 1)[rank],
            "swiglu.weight": torch.cat([sw0.chunk(TP)[rank], sw1.chunk(TP)[rank]])}


def write_checkpoint(root, *, drop: str | None = None) -> dict[str, torch.Tensor]:
    """A TP=2, DP=1, ZeRO-1 DeepSpeed tag directory; returns the consolidated tensors it encodes."""
    full = _full_tensors()
    info = {"universal_checkpoint_version": 0.4, "original_vocab_size": 5,
            "tp_replicated_parameter_patterns": [r"^norm\.weight$"],
            "parameter_with_row_parallelism_patterns": [r"^proj\.weight$"],
            "vocabulary_parameter_patterns": [r"^embed\.weight$"],
            "parameter_with_2_sub_params_cat_dim_0": [r"^swiglu\.weight$"],
            "affine_map": {"version": 1, "params": {r"^mlp\.gate_up_proj\.weight$": _fused_gate_up_map(6, 4),
                                                    r"^norm\.weight$": _replicated_map((4,))}}}
    tag = root / "step3"
    tag.mkdir(parents=True)
    (root / "latest").write_text("step3")
    for rank in range(TP):
        local = _shards(full, rank)
        flat = torch.cat([t.reshape(-1) for t in local.values()])
        torch.save({"module": local, "param_shapes": [{n: t.shape for n, t in local.items()}], "buffer_names": [],
                    "mp_world_size": TP, "dp_world_size": 1, "global_steps": 3, "ds_version": "0.19.8",
                    "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": TP},
                    "universal_checkpoint_info": info}, tag / f"mp_rank_{rank:02d}_model_states.pt")
        state = {"exp_avg": flat * 0.5, "exp_avg_sq": flat.square(), "step": torch.tensor(3.0)}
        torch.save({"optimizer_state_dict": {"zero_stage": 1, "single_partition_of_fp32_groups": [flat],
                                             "group_paddings": [0], "base_optimizer_state": {"state": {0: state}}}},
                   tag / f"zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt")
    if drop:
        (tag / drop).unlink()
    return full


def test_documented_layout_consolidates_every_pattern(tmp_path):
    full = write_checkpoint(tmp_path / "ds")
    ckpt = import_deepspeed(tmp_path / "ds", tmp_path / "uc")
    manifest = uc.verify_checkpoint(ckpt)
    assert manifest.step == 3 and manifest.layout.mesh == {"tp": 2, "pp": 1, "dp": 1}
    for name, tensor in full.items():
        assert torch.equal(uc.read_full(ckpt, manifest, manifest.tensors[f"model/model.{name}"]), tensor), name
        moment = uc.read_full(ckpt, manifest, manifest.tensors[f"model/optim.exp_avg.{name}"])
        assert torch.equal(moment, tensor * 0.5), name  # moments follow their parameter's layout
    patterns = {e.name: e.pattern for e in manifest.tensors.values()}
    assert patterns["model.mlp.gate_up_proj.weight"] == {"dim": 0, "group": "tp", "parts": [6, 6]}
    assert patterns["model.norm.weight"] == {"dim": None, "group": "tp"}
    assert patterns["model.proj.weight"] == {"dim": 1, "group": "tp"}
    assert patterns["model.embed.weight"] == {"dim": 0, "group": "tp", "padded_size": 6, "vocab_size": 5}
    assert patterns["model.swiglu.weight"] == {"dim": 0, "group": "tp", "parts": [4, 4]}


@pytest.mark.parametrize("missing", ["mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"])
def test_missing_file_names_file_tensor_and_fix(tmp_path, missing):
    write_checkpoint(tmp_path / "ds", drop=missing)
    with pytest.raises(uc.CheckpointFormatError) as info:
        import_deepspeed(tmp_path / "ds", tmp_path / "uc")
    message = str(info.value)
    assert missing in message and "gate_up_proj.weight" in message and "copy it" in message, message
    assert not (tmp_path / "uc").exists()


def test_drifted_replicas_and_broken_maps_are_refused():
    norm = _replicated_map((4,))
    with pytest.raises(uc.CheckpointFormatError, match="norm.weight.*different copies"):
        deepspeed_mp._rebuild_affine("norm.weight", norm, [torch.zeros(4), torch.ones(4)])
    fused = _fused_gate_up_map(6, 4)
    fused["ranks"][1]["pieces"].pop()  # rank 1's up rows described nowhere
    with pytest.raises(uc.CheckpointFormatError, match="uncovered"):
        deepspeed_mp._rebuild_affine("w", fused, [torch.zeros(6, 4), torch.zeros(6, 4)])
    with pytest.raises(uc.CheckpointFormatError, match="TP rank 0 holds 8 elements"):
        deepspeed_mp._rebuild_affine("w", _fused_gate_up_map(6, 4), [torch.zeros(2, 4), torch.zeros(6, 4)])
    info = {"tp_replicated_parameter_patterns": [r"^n$"]}
    with pytest.raises(uc.CheckpointFormatError, match="TP-replicated copies differ"):
        deepspeed_mp._merge_by_patterns("n", info, [torch.zeros(2), torch.ones(2)])
    averaged, pattern = deepspeed_mp._merge_by_patterns("a", {"parameter_to_average_patterns": [r"^a$"]},
                                                        [torch.zeros(2), torch.full((2,), 2.0)])
    assert torch.equal(averaged, torch.ones(2))
    assert pattern == {"dim": None, "group": "tp", "average": True}  # plait's language says it too
