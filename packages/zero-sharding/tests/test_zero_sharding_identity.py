"""Global identity of parameters that live on some ranks only (experts under expert parallelism):
the sharded state dict names them globally, ``export_full_weights`` writes the whole model, and
the export loads back whole, into one process or into the sharded model."""

from __future__ import annotations

import math
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
    for stage in (1, 2, 3):
        results = run_distributed(_export_and_reload, 2, str(tmp_path), stage, timeout=90)
        for rank, result in enumerate(results):
            assert result["names"] and all(n.startswith(f"model.experts.{rank}.") for n in result["names"])
            assert result["reloaded"] == 0.0
        whole = results[0]["whole"]
        assert whole.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(whole[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


LOCAL_EXPERTS = 2


class Stacked(torch.nn.Module):
    """A dense trunk around experts stored as stacked parameters ``[experts, out, in]`` (the
    grouped-GEMM layout); ``forward`` runs only the experts named."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.experts = torch.nn.Module()
        self.experts.w_in = torch.nn.Parameter(torch.randn(experts, 24, 16) * 0.2)
        self.experts.w_out = torch.nn.Parameter(torch.randn(experts, 16, 24) * 0.2)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use: list[int]) -> torch.Tensor:
        h = self.embed(x)
        w_in, w_out = self.experts.w_in, self.experts.w_out
        return self.head(h + sum(torch.nn.functional.gelu(h @ w_in[e].T) @ w_out[e].T for e in use)).square().mean()


def _stacked_uses(step: int, rank: int) -> list[int]:
    """Local experts rank ``rank`` runs at ``step``: rank 0 all of them, the others one that moves."""
    return list(range(LOCAL_EXPERTS)) if rank == 0 else [(step + rank) % LOCAL_EXPERTS]


def stacked_reference(world: int, steps: int) -> Stacked:
    """One process, every expert stacked: rank r's batch goes through global experts
    ``r * LOCAL_EXPERTS + e`` for its local ``e``; SGD(lr=0.5)."""
    torch.manual_seed(0)
    reference = Stacked(LOCAL_EXPERTS * world)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(steps):
        loss = sum(reference(_routed_batch(step, r)[0], [r * LOCAL_EXPERTS + e for e in _stacked_uses(step, r)])
                   for r in range(world)) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference


def _stacked_expert_parallel(stage: int) -> tuple:
    """This rank's part of ``Stacked(LOCAL_EXPERTS * world)``: the dense trunk and rows
    ``[rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)`` of each stacked expert parameter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    whole = Stacked(LOCAL_EXPERTS * world)
    model = Stacked(LOCAL_EXPERTS)
    rows = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    model.load_state_dict({k: v[rows] if k.startswith("experts.") else v for k, v in whole.state_dict().items()})
    experts = list(model.experts.parameters())
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]

    def global_of(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
        return name, (shape[0] * world, *shape[1:]), rank * LOCAL_EXPERTS

    return zero_shard(model, torch.optim.SGD, ZeroConfig(stage=stage, param_persistence_threshold=0), lr=0.5,
                      param_groups=[{"params": dense},
                                    {"params": experts, "zero_group": singles[rank], "zero_global": global_of}])


def _stacked_expert_parallel_untrained(name: str, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of ``name`` as initialised, before any training."""
    torch.manual_seed(0)
    return Stacked(LOCAL_EXPERTS * dist.get_world_size()).state_dict()[name][rows]


def _stacked_export_and_reload(tmp: str, stage: int) -> dict:
    rank = dist.get_rank()
    model, optimizer = _stacked_expert_parallel(stage)
    for step in range(STEPS):
        model(_routed_batch(step, rank)[0], _stacked_uses(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()
    specs = {n: (tuple(t.spec.global_shape), tuple(t.spec.flat_range))
             for n, t in model.sharded_state_dict().items() if n.startswith("model.experts.")}
    path = Path(tmp) / f"stacked{stage}.safetensors"
    model.export_full_weights(path)
    dist.barrier()
    whole = _read_safetensors(path)
    fresh, _ = _stacked_expert_parallel(stage)  # untrained: loading the export must bring this rank's rows
    fresh.load_state_dict(whole)
    mine, theirs = model.state_dict(), fresh.state_dict()  # whole: every rank's rows, global shapes
    rows = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    with fresh.gathered_parameters():  # the live local parameters hold this rank's rows
        own = {f"experts.{n}": p.detach().clone() for n, p in fresh.experts.named_parameters()}
    return {"specs": specs, "whole": whole if rank == 0 else None,
            "reloaded": max((mine[k] - theirs[k]).abs().max().item() for k in mine),
            "rows": max((theirs[k] - whole[k]).abs().max().item() for k in theirs if k.startswith("experts.")),
            "own_rows": max((own[k] - whole[k][rows]).abs().max().item() for k in own),
            "untrained": max((mine[k] - _stacked_expert_parallel_untrained(k, slice(None))).abs().max().item()
                             for k in mine if k.startswith("experts."))}


def test_stacked_experts_at_a_row_offset_exported_and_reloaded_whole(tmp_path):
    world = 2
    reference = {k: v.detach() for k, v in stacked_reference(world, STEPS).state_dict().items()}
    for stage in (1, 2, 3):
        results = run_distributed(_stacked_export_and_reload, world, str(tmp_path), stage, timeout=90)
        for rank, result in enumerate(results):
            # The sharded state dict names each rank's rows of the global stacked tensor.
            assert set(result["specs"]) == {"model.experts.w_in", "model.experts.w_out"}
            for name, (shape, (start, stop)) in result["specs"].items():
                global_shape = tuple(reference[name.removeprefix("model.")].shape)
                row = math.prod(global_shape[1:])
                assert shape == global_shape
                assert (start, stop) == (rank * LOCAL_EXPERTS * row, (rank + 1) * LOCAL_EXPERTS * row), name
            assert result["untrained"] > 0  # training moved the experts, so reloading them is not trivial
            assert result["reloaded"] == 0.0
            assert result["rows"] == 0.0
            assert result["own_rows"] == 0.0
        whole = results[0]["whole"]
        assert whole.keys() == reference.keys()
        for name, value in reference.items():
            assert whole[name].shape == value.shape, name
            torch.testing.assert_close(whole[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
