"""Global identity of parameters that live on some ranks only (experts under expert parallelism):
the sharded state dict names them globally, ``export_full_weights`` writes the whole model, and
the export loads back whole, into one process or into the sharded model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from test_zero_sharding_composition import _expert_parallel_model, _routed_batch, expert_parallel_reference

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

STEPS = 2


def _expert_parallel(stage: int) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    model = _expert_parallel_model(world, rank)
    experts = list(model.experts.parameters())
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]

    def global_of(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
        return name.replace("experts.0.", f"experts.{rank}.", 1), shape, 0  # local expert 0 is expert `rank`

    return zero_shard(model, torch.optim.SGD, ZeroConfig(stage=stage, param_persistence_threshold=0), lr=0.5,
                      param_groups=[{"params": dense},
                                    {"params": experts, "zero_group": singles[rank], "zero_global": global_of}])


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The file read by the format's published layout (8-byte header length, JSON header, raw data),
    not by plait's writer: plait-zero-sharding alone does not install the safetensors package."""
    import json
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header.pop("__metadata__", None)
    data = bytearray(raw[8 + length:])
    return {name: torch.frombuffer(data, dtype=_DTYPES[entry["dtype"]], offset=entry["data_offsets"][0],
                                   count=(entry["data_offsets"][1] - entry["data_offsets"][0])
                                   // _DTYPES[entry["dtype"]].itemsize).reshape(entry["shape"]).clone()
            for name, entry in header.items()}


def _export_and_reload(tmp: str, stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = _expert_parallel(stage)
    for step in range(STEPS):
        model(_routed_batch(step, rank)[0], [0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    names = sorted(n for n in model.sharded_state_dict() if n.startswith("model.experts."))
    path = Path(tmp) / f"stage{stage}.safetensors"
    model.export_full_weights(path)
    dist.barrier()
    whole = _read_safetensors(path)
    fresh, _ = _expert_parallel(stage)  # untrained: loading the export must bring every rank's own expert
    fresh.load_state_dict(whole)
    mine, theirs = model.state_dict(), fresh.state_dict()
    return {"names": names, "whole": whole if rank == 0 else None,
            "reloaded": max((mine[k] - theirs[k]).abs().max().item() for k in mine), "world": world}


def test_expert_parallel_model_exported_and_reloaded_whole(tmp_path):
    reference = expert_parallel_reference(2, STEPS).state_dict()
    for stage in (2, 3):
        results = run_distributed(_export_and_reload, 2, str(tmp_path), stage, timeout=90)
        for rank, result in enumerate(results):
            assert result["names"] and all(n.startswith(f"model.experts.{rank}.") for n in result["names"])
            assert result["reloaded"] == 0.0
        whole = results[0]["whole"]
        assert whole.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(whole[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
