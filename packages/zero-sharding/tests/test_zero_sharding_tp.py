"""ZeRO over torch tensor parallelism: W=4 as dp2 x tp2, parameters made DTensors by
``parallelize_module`` on ``tp`` and sharded by plait over ``dp``.

One spawn of 4 ranks runs every case: an MLP (colwise / rowwise Linears and a plain Linear) and
a small transformer (colwise q/k/v, rowwise out and MLP, RMSNorms under SequenceParallel, whose
weight gradients are ``Partial`` on tp), at stages 1, 2, 3. Each is compared with one process on
the whole batch and with FSDP2 (``fully_shard(model, mesh=mesh["dp"])``) on the same TP model;
clipping and gradient accumulation under ``no_sync`` are compared with one process;
communication is counted per mesh dimension against the formula; bad input is refused before
any work.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, model_state_bytes, zero_shard
from plait.zero_sharding.extension import DefaultReducer

sys.path.insert(0, str(Path(__file__).parent))
from test_zero_sharding_identity import _read_safetensors

STEPS = 5
BATCH, SEQ, FEATURES, DIM, HEADS = 4, 4, 8, 16, 4
OPT = dict(lr=1e-2, weight_decay=0.01)
CLIP = 0.05  # well below the gradient norms of these models: clipping acts on every step


class Attention(nn.Module):
    """Self-attention over local heads: under colwise q/k/v each TP rank holds HEADS / tp of them."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm transformer block (RMSNorm, attention, MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Input projection, two blocks, final norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, FEATURES), nn.Linear(FEATURES, FEATURES))
    return Transformer()


def plan(kind: str) -> dict:
    """torchtitan-style plans: the transformer keeps activations sequence-sharded between blocks."""
    if kind == "mlp":  # the last Linear stays a plain (replicated) parameter
        return {"0": ColwiseParallel(), "2": RowwiseParallel()}
    to_full = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                 use_local_output=True)
    out = {"inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel(use_local_output=True),
           "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(2):
        out.update({f"layers.{i}.norm1": SequenceParallel(use_local_output=True), f"layers.{i}.attn": to_full,
                    f"layers.{i}.attn.q": ColwiseParallel(), f"layers.{i}.attn.k": ColwiseParallel(),
                    f"layers.{i}.attn.v": ColwiseParallel(),
                    f"layers.{i}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                    f"layers.{i}.norm2": SequenceParallel(use_local_output=True), f"layers.{i}.mlp": to_full,
                    f"layers.{i}.mlp.0": ColwiseParallel(),
                    f"layers.{i}.mlp.2": RowwiseParallel(output_layouts=Shard(1))})
    return out


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, FEATURES, generator=g)
    return x, torch.randn(BATCH, SEQ, FEATURES, generator=g)


def reference(kind: str, clip: float | None) -> tuple[list[float], list[float]]:
    """One process, the whole batch: losses and (when clipping) the gradient norms."""
    model, (x, y) = build(kind), data()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _train(model: nn.Module, opt: torch.optim.Optimizer, dp: dist.ProcessGroup, clip: float | None,
           ledger: ByteLedger | None = None) -> tuple[list[float], list[float]]:
    """STEPS steps on this dp rank's half of the batch; losses averaged over dp."""
    x, y = data()
    half = BATCH // dist.get_world_size(dp)
    rows = slice(dist.get_rank(dp) * half, (dist.get_rank(dp) + 1) * half)
    losses, norms = [], []
    for step in range(STEPS):
        if ledger is not None and step == STEPS - 1:
            ledger.__enter__()  # the last step only: one step's bytes
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        if ledger is not None and step == STEPS - 1:
            ledger.__exit__()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp)
        losses.append(float(mean) / dist.get_world_size(dp))
    return losses, norms


def _expected_dp_bytes(model: nn.Module, stage: int) -> int:
    """Logical bytes of one step on dp from the 2-D formula: every unit moves its padded local
    (TP-shard) numel per all-gather and reduce-scatter (wire bytes: that times (dp-1)/dp)."""
    engine, total = model.zero_engine, 0
    for unit in engine.units:
        nbytes = unit.padded_numel * unit.full.element_size()
        if unit.resident:
            total += 2 * nbytes  # reduce-scatter + post-step all-gather
        elif unit in engine.partition.root_units:
            total += 2 * nbytes  # gathered once, forward to end of backward; reduce-scatter
        else:
            total += 3 * nbytes  # forward gather, backward gather, reduce-scatter
    return total


def _sharded_runs() -> dict:
    start = time.perf_counter()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = mesh["dp"].get_group(), mesh["tp"].get_group()
    dp_name = "ranks[" + ",".join(map(str, dist.get_process_group_ranks(dp_group))) + "]"
    tp_name = "ranks[" + ",".join(map(str, dist.get_process_group_ranks(tp_group))) + "]"
    out: dict = {"zero": {}, "fsdp": {}, "bytes": {}, "state": {}}
    for kind in ("mlp", "transformer"):
        for stage in (1, 2, 3):
            model = parallelize_module(build(kind), mesh["tp"], plan(kind))
            local_numel = sum(p._local_tensor.numel() if isinstance(p, DTensor) else p.numel()
                              for p in model.parameters())
            sp_norm_numel = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
            model, opt = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage), mesh=mesh["dp"], **OPT)
            ledger = ByteLedger()
            out["zero"][kind, stage] = _train(model, opt, dp_group, None, ledger)[0]
            assert all(isinstance(p, DTensor) for n, p in model.named_parameters() if not n.startswith("3."))
            units = model.zero_engine.units
            out["bytes"][kind, stage] = ({g: ledger.total(group=g) for g in (dp_name, tp_name, "world")},
                                         {dp_name: _expected_dp_bytes(model, stage),
                                          tp_name: 4 * sp_norm_numel, "world": 16})
            # AdamW: exp_avg and exp_avg_sq over each unit's dp shard, plus a float32 step scalar per unit
            out["state"][kind, stage] = (model_state_bytes(model)["optimizer"],
                                         2 * 4 * sum(u.shard_numel for u in units) + 4 * len(units),
                                         sum(u.numel for u in units), local_numel)
        model = parallelize_module(build(kind), mesh["tp"], plan(kind))
        for layer in getattr(model, "layers", []):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        out["fsdp"][kind] = _train(model, torch.optim.AdamW(model.parameters(), **OPT), dp_group, None)[0]
        with pytest.raises(ValueError, match=r"'(0|inp).weight' is a DTensor over mesh dimension 'dp' \(placement "
                                             r"_?S.*data-parallel ranks already \(fully_shard applied first\?\)"):
            zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=2), mesh=mesh["dp"])
    model = parallelize_module(build("transformer"), mesh["tp"], plan("transformer"))
    model, opt = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh["dp"], **OPT)
    out["clipped"] = _train(model, opt, dp_group, CLIP)
    out["accumulated"] = _accumulate(mesh, dp_group)
    _bad_input(mesh)
    out["state_dicts"] = _whole_and_sharded_state(mesh, dp_group)
    out["seconds"] = time.perf_counter() - start
    return out


def _accumulate(mesh, dp_group: dist.ProcessGroup) -> list[float]:
    """Stage 3, two micro-batches per step, the first under ``no_sync``: the SequenceParallel
    norms' ``Partial`` gradients accumulate as DTensors and are reduced over tp once."""
    model = parallelize_module(build("transformer"), mesh["tp"], plan("transformer"))
    model, opt = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh["dp"], **OPT)
    (x, y), half = data(), BATCH // dist.get_world_size(dp_group)
    losses = []
    for _ in range(STEPS):
        total = torch.zeros(())
        for micro in range(half):
            row = slice(dist.get_rank(dp_group) * half + micro, dist.get_rank(dp_group) * half + micro + 1)
            with model.no_sync() if micro < half - 1 else contextlib.nullcontext():
                loss = F.mse_loss(model(x[row]), y[row]) / half
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total, group=dp_group)
        losses.append(float(total) / dist.get_world_size(dp_group))
    return losses


def _bad_input(mesh) -> None:
    """Refused on every rank before any collective, naming the parameter or option."""
    def tp_mlp() -> nn.Module:
        return parallelize_module(build("mlp"), mesh["tp"], plan("mlp"))

    with pytest.raises(ValueError, match=r"reducer= is not supported with tensor-parallel.*ZeroConfig.zeropp"):
        zero_shard(tp_mlp(), torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh["dp"], reducer=DefaultReducer())
    with pytest.raises(ValueError, match=r"replicate over \(HSDP\).*mesh=mesh\['dp'\]"):
        zero_shard(tp_mlp(), torch.optim.AdamW, ZeroConfig(stage=2), mesh=mesh)
    with pytest.raises(ValueError, match=r"'0.weight' is torch.float32 but ZeroConfig.compute_dtype is torch.bfloat16"):
        zero_shard(tp_mlp(), torch.optim.AdamW, ZeroConfig(stage=1, compute_dtype="bf16"), mesh=mesh["dp"])
    for placement in (Partial(), _strided()):
        model = tp_mlp()
        weight = model[3].weight
        model[3].weight = nn.Parameter(DTensor.from_local(weight.detach(), mesh["tp"], [placement], run_check=False))
        with pytest.raises(ValueError, match=r"parameter '3.weight' has placement .* Shard\(d\) or Replicate\(\) only"):
            zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=1), mesh=mesh["dp"])
    # A custom style that distributes over the whole (dp, tp) mesh: Replicate() on dp, Shard(0) on tp.
    model = build("mlp")
    distribute_module(model[0], mesh, _two_d_partition)
    with pytest.raises(ValueError, match=r"'0.weight' is a DTensor over mesh dimension 'dp' \(placement R.*"
                                         r"whole \(dp, tp\) mesh.*parallelize_module\(model, mesh\['tp'\], plan\)"):
        zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=1), mesh=mesh["dp"])
    # A 1-D data-parallel mesh of 3 of the 4 ranks (every rank builds the mesh and the model:
    # DeviceMesh creates its group on every rank, parallelize_module scatters over tp).
    three, model = DeviceMesh("cpu", torch.arange(3), mesh_dim_names=("dp",)), tp_mlp()
    if dist.get_rank() < 3:
        with pytest.raises(ValueError, match=r"data-parallel mesh has 3 ranks, which does not divide the world of 4"):
            zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=1), mesh=three)


def _two_d_partition(name: str, module: nn.Module, mesh) -> None:
    """A partition function for ``distribute_module`` placing each parameter over both mesh dimensions."""
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate(), Shard(0)])))


def _whole_and_sharded_state(mesh, dp_group: dist.ProcessGroup) -> dict:
    """state_dict / load_state_dict / export_full_weights / sharded_state_dict of a TP model under
    ZeRO-3: whole tensors equal the unsharded model's, and every rank's written pieces, placed at
    their boxes / flat ranges, tile each global tensor exactly once with the right values."""
    model, opt = zero_shard(parallelize_module(build("mlp"), mesh["tp"], plan("mlp")), torch.optim.AdamW,
                            ZeroConfig(stage=3), mesh=mesh["dp"], **OPT)
    out = {"initial": model.state_dict()}  # collective over dp and tp: every rank gets whole tensors
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, FEATURES), nn.Linear(FEATURES, FEATURES))
    model.load_state_dict(other.state_dict())
    out["reloaded"], out["other"] = model.state_dict(), other.state_dict()
    x, y = data()
    out["forward"] = (model(x).detach(), other(x).detach())
    _train(model, opt, dp_group, None)  # optimizer state exists and differs from the masters
    pieces = model.sharded_state_dict()
    mine = [(piece.spec, piece.local.clone()) for piece in pieces.values()
            if piece.spec.writer_rank == dist.get_rank() and piece.spec.kind != "other"]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out["boxes"] = sum(1 for piece in pieces.values() if piece.spec.slices is not None)
    out["pieces"] = [entry for theirs in everyone for entry in theirs]
    out["trained"] = model.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        written = model.export_full_weights(path)
        out["exported"] = _read_safetensors(written) if written is not None else None
    return out


def _check_state(out: dict) -> None:
    expected = build("mlp").state_dict()
    initial = out["initial"]
    assert initial.keys() == expected.keys() and all(torch.equal(initial[k], expected[k]) for k in initial)
    assert all(torch.equal(out["reloaded"][k], out["other"][k]) for k in out["other"])
    torch.testing.assert_close(*out["forward"], rtol=1e-6, atol=1e-6)
    assert out["boxes"] > 0  # the row-wise weight (Shard(1)) is described by boxes, not flat ranges
    trained = out["trained"]
    assert trained.keys() == expected.keys() and not torch.equal(trained["0.weight"], expected["0.weight"])
    if out["exported"] is not None:
        assert all(torch.equal(out["exported"][k], trained[k]) for k in trained)
    tiled: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    unique: dict[tuple, torch.Tensor] = {}  # plain parameters: each tp rank names itself (a checkpoint keeps one)
    for spec, local in out["pieces"]:
        where = (spec.name, spec.flat_range, spec.slices)
        if where in unique:
            assert torch.equal(unique[where], local), spec.name
            continue
        unique[where] = local
        values, counts = tiled.setdefault(spec.name, (torch.zeros(spec.global_shape, dtype=spec.dtype),
                                                     torch.zeros(spec.global_shape, dtype=torch.int32)))
        spec.index_into(values).copy_(local.reshape(spec.index_into(values).shape))
        spec.index_into(counts).add_(1)
    for name, tensor in trained.items():
        values, counts = tiled[f"model.{name}"]
        assert torch.equal(counts, torch.ones_like(counts)), name  # each element written exactly once
        assert torch.equal(values, tensor), name
        assert torch.equal(tiled[f"optim.exp_avg.{name}"][1], counts), name


def _strided():
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(0, split_factor=2)


@pytest.mark.timeout(330)
def test_zero_over_tensor_parallel_matches_one_process_and_fsdp2():
    results = run_distributed(_sharded_runs, 4, timeout=300)
    for kind in ("mlp", "transformer"):
        ref = torch.tensor(reference(kind, None)[0], dtype=torch.float64)
        for rank, out in enumerate(results):
            fsdp = torch.tensor(out["fsdp"][kind], dtype=torch.float64)
            torch.testing.assert_close(fsdp, ref, rtol=1e-5, atol=0)
            for stage in (1, 2, 3):
                ours = torch.tensor(out["zero"][kind, stage], dtype=torch.float64)
                msg = f"{kind} stage {stage} rank {rank}"
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0, msg=msg)
                torch.testing.assert_close(ours, fsdp, rtol=1e-6, atol=0, msg=msg)
                measured, expected = out["bytes"][kind, stage]
                assert measured == expected, msg
                state, formula, unit_numel, local_numel = out["state"][kind, stage]
                assert state == formula and unit_numel == local_numel, msg  # 1/dp of each TP shard
    for out in results:
        _check_state(out["state_dicts"])
    print(f"ranks' time in the cases: {max(out['seconds'] for out in results):.1f} s, load {os.getloadavg()[0]:.1f}")
    ref = reference("transformer", None)[0]
    for out in results:
        torch.testing.assert_close(torch.tensor(out["accumulated"]), torch.tensor(ref), rtol=1e-5, atol=0)
    ref_losses, ref_norms = reference("transformer", CLIP)
    for out in results:
        losses, norms = out["clipped"]
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_flat_range_boxes_tile_the_range_in_order():
    """Every flat range of 1- to 3-D tensors splits into boxes whose elements, read box by box in
    row-major order, are exactly the range (the views checkpoint pieces are made of)."""
    from plait.zero_sharding.tensor_parallel_state import flat_range_boxes

    for shape in ((7,), (3, 5), (2, 3, 4), (1, 6), (4, 1, 3)):
        numbers = torch.arange(torch.Size(shape).numel()).view(shape)
        for lo in range(numbers.numel() + 1):
            for hi in range(lo, numbers.numel() + 1):
                boxes = flat_range_boxes(shape, lo, hi)
                assert len(boxes) <= 2 * len(shape) - 1 or hi == lo, (shape, lo, hi, boxes)
                got = [numbers[tuple(slice(a, b) for a, b in box)].reshape(-1) for box, _, _ in boxes]
                assert torch.equal(torch.cat(got) if got else torch.zeros(0, dtype=torch.long),
                                   torch.arange(lo, hi)), (shape, lo, hi, boxes)
                assert [start for _, start, _ in boxes] == [lo] + [stop for _, _, stop in boxes][:-1] or not boxes
