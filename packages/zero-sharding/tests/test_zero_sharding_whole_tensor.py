"""Whole-tensor optimizers under ZeRO 1/2/3 (Muon + AdamW, LAMB, Adafactor, a user's own): the
weights after training equal, bit for bit, one process running the same optimizer on the same
averaged gradients (the reference adds the two ranks' gradients and halves them, as the
reduce-scatter does); owners balanced by update cost; undeclared optimizers and bad groups refused.

All jobs of the world size run in one set of processes (spawning ranks costs seconds)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import MODEL, build_model

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import global_batch, rank_slice, run_distributed, tiny_llama
from plait.zero_sharding import (
    ConstructedParameter,
    LocalPlacement,
    ZeroConfig,
    model_state_bytes,
    sharded_init,
    zero_shard,
)
from plait.zero_sharding.muon import MuonWithAdamW, muon_param_groups
from plait.zero_sharding.whole_tensor import (
    WholeTensorPlacement,
    _copy_flat_range,
    _flat_range,
    assign_owners,
    register_whole_tensor,
    update_cost,
)

BATCH, SEQ, STEPS, WORLD = 4, 16, 3, 2


class NormalizedSGD(torch.optim.Optimizer):
    """A user's own whole-tensor optimizer: each tensor moves by ``lr`` along its gradient's direction
    (the norm needs the whole tensor). Declared through the documented class attribute."""

    whole_tensor = True

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


@register_whole_tensor
class ReferenceLamb(torch.optim.Optimizer):
    """LAMB (Adam moments, update scaled by the trust ratio ||p|| / ||update|| of the whole tensor),
    declared through register_whole_tensor rather than the class attribute."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = state["m"] / (1 - b1 ** state["step"])
                v_hat = state["v"] / (1 - b2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-lr * trust)


def _optimizers() -> dict[str, tuple[Any, dict[str, Any], bool]]:
    """name -> (class, options, groups the Muon way)."""
    out: dict[str, tuple[Any, dict[str, Any], bool]] = {
        "muon": (MuonWithAdamW, dict(lr=0.02, adamw_lr=1e-3), True),
        "user": (NormalizedSGD, dict(lr=0.01), False),
    }
    out["lamb"] = (ReferenceLamb, dict(lr=1e-3, weight_decay=0.01), False)
    try:
        from transformers.optimization import Adafactor
        out["adafactor"] = (Adafactor, dict(lr=1e-3, relative_step=False, scale_parameter=False,
                                            warmup_init=False), False)
    except ImportError:
        pass
    return out


JOBS = [("muon", 1), ("muon", 2), ("muon", 3), ("user", 2), ("lamb", 3), ("adafactor", 1)]


def _make(name: str, model: torch.nn.Module, params: Any = None) -> tuple[Any, dict[str, Any], Any]:
    cls, options, grouped = _optimizers()[name]
    groups = muon_param_groups(model) if grouped else None
    return cls, options, groups


def _rank_jobs(jobs: list[tuple[str, int]]) -> list[dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for name, stage in jobs:
        model = build_model()
        cls, options, groups = _make(name, model)
        config = ZeroConfig(stage=stage, reduce_dtype=torch.float32, param_persistence_threshold=0)
        model, optimizer = zero_shard(model, cls, config, param_groups=groups, **options)
        assert isinstance(model.zero_engine.placement, WholeTensorPlacement)
        for step in range(STEPS):
            model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss.backward()
            if name == "muon" and stage > 1 and step == STEPS - 1:  # gradients present, state allocated
                assert model_state_bytes(model) == _expected_muon_bytes(model.zero_engine, groups, stage), stage
            with ByteLedger() as ledger:
                optimizer.step()
            optimizer.zero_grad()
        counted = {"all_gather": ledger.total(op="all_gather"), "broadcast": ledger.total(op="broadcast"),
                   "broadcasts": sum(record.op == "broadcast" for record in ledger.records)}
        assert counted == _expected_step_bytes(model.zero_engine), (name, stage, counted)
        if (name, stage) == ("muon", 2):  # per-tensor state: whole pieces under global names, on the owner
            pieces = model.sharded_state_dict()
            owned = {slot.name for unit in model.zero_engine.units for slot in unit.slots
                     if (unit.key, slot.name) in model.zero_engine.placement.whole}
            momentum = {n.removeprefix("optim.momentum_buffer.") for n in pieces if n.startswith("optim.momentum")}
            assert momentum and momentum <= owned
        if name == "adafactor":  # factored moments whole in their own shapes, the step as a number
            pieces = model.sharded_state_dict()
            rows = [n for n in pieces if n.startswith("optim.exp_avg_sq_row.")]
            assert rows and all(pieces[n].spec.global_shape == pieces[n].local.shape for n in rows)
        state = model.state_dict()
        out.append({k: v.clone() for k, v in state.items()} if rank == 0 else {})
    return out


def _expected_muon_bytes(engine: Any, groups: list[dict[str, Any]], stage: int) -> dict[str, int]:
    """Model-state bytes of MuonWithAdamW in fp32 from the layout and the owner map: the parameters
    (stage 2: every unit's whole padded buffer; stage 3: the shard), the reduced gradient shard, no
    separate flat master (in fp32 the shard is the master) but 4 bytes per element of each tensor
    this rank owns (its whole fp32 copy), Muon's momentum (4 bytes per owned element) and AdamW's
    two moments (8 bytes per owned element) plus its fp32 step counter per owned tensor."""
    muon = {id(p) for p in groups[0]["params"]}
    out = {"params": 0, "grads": 0, "master": 0, "optimizer": 0}
    for unit in engine.units:
        out["params"] += 4 * (unit.padded_numel if stage < 3 else unit.shard_numel)
        out["grads"] += 4 * unit.shard_numel
        for slot in unit.slots:
            if engine.placement.owner[(unit.key, slot.name)] != unit.group_rank:
                continue
            out["master"] += 4 * slot.numel
            out["optimizer"] += 4 * slot.numel if id(slot.param) in muon else 8 * slot.numel + 4
    out["total"] = sum(out.values())
    return out


def _expected_step_bytes(engine: Any) -> dict[str, int]:
    """Logical bytes of one step's gathers and broadcasts, from the layout: per unit, the
    whole-tensor all-gather of gradient and master shards (2 x padded fp32) plus, stages 1/2, the
    refresh of the resident parameters (padded x 4); the bytes of every tensor whose elements lie on
    a rank other than its owner, in one broadcast per unit and owner of such tensors."""
    placement = engine.placement
    gather, broadcast, senders = 0, 0, set()
    for unit in engine.units:
        gather += 2 * unit.padded_numel * 4 + (unit.padded_numel * 4 if unit.resident else 0)
        for slot in unit.slots:
            start, stop = slot.flat_range
            holders = set(range(start // unit.shard_numel, (stop - 1) // unit.shard_numel + 1))
            owner = placement.owner[(unit.key, slot.name)]
            if holders - {owner}:
                broadcast += slot.numel * 4
                senders.add((unit.key, owner))
    return {"all_gather": gather, "broadcast": broadcast, "broadcasts": len(senders)}


def _reference(name: str) -> dict[str, torch.Tensor]:
    """One process: each rank's half batch backward separately, gradients summed and halved."""
    model = build_model()
    cls, options, groups = _make(name, model)
    optimizer = cls(groups if groups is not None else model.parameters(), **options)
    params = list(model.parameters())
    for step in range(STEPS):
        batch = global_batch(step, BATCH, SEQ)
        total = [torch.zeros_like(p) for p in params]
        for rank in range(WORLD):
            model(**rank_slice(batch, rank, WORLD)).loss.backward()
            for acc, p in zip(total, params):
                acc.add_(p.grad)
                p.grad = None
        for acc, p in zip(total, params):
            p.grad = acc * (1.0 / WORLD)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_whole_tensor_optimizers_match_one_process_bitwise() -> None:
    jobs = [job for job in JOBS if job[0] in _optimizers()]
    results = run_distributed(_rank_jobs, WORLD, jobs, timeout=240.0)[0]
    for (name, stage), params in zip(jobs, results):
        reference = _reference(name)
        for pname, ref in reference.items():
            assert torch.equal(params[pname], ref), f"{name} stage {stage}: {pname} differs from one process " \
                f"by {(params[pname] - ref).abs().max().item():.3g}"
        moved = max((reference[n] - v).abs().max().item() for n, v in build_model().named_parameters())
        assert moved > 1e-4, f"{name} did not train"


def test_owners_balance_newton_schulz_cost_not_bytes() -> None:
    # One 256x256 matrix costs 256**3; sixteen 64x1024 matrices (same bytes each) cost 64**2*1024 each.
    costs = [update_cost((256, 256))] + [update_cost((64, 1024))] * 4
    assert costs[0] == 256 ** 3 and costs[1] == 64 * 1024 * 64
    owners = assign_owners(costs, 2)
    assert owners[0] == 0 and owners[1:] == [1, 1, 1, 1]  # bytes would have split them 1 + 2 / 3
    assert update_cost((5,)) == 5.0


def test_owner_reads_a_tensor_in_one_shard_as_a_view_and_copies_only_across_shards() -> None:
    # Two ranks' gathered shards of a 10-element unit; the owner reads its tensors' ranges from them.
    shards = [torch.arange(0.0, 5.0), torch.arange(5.0, 10.0)]
    inside = _flat_range(shards, (6, 9), 5)
    assert torch.equal(inside, torch.arange(6.0, 9.0))
    assert inside.data_ptr() == shards[1][1:].data_ptr()  # no copy: one rank holds it all
    across = _flat_range(shards, (3, 8), 5)
    assert torch.equal(across, torch.arange(3.0, 8.0))
    out = torch.zeros(5)
    _copy_flat_range(out, shards, (3, 8), 5)
    assert torch.equal(out, torch.arange(3.0, 8.0))


def test_undeclared_whole_tensor_optimizer_is_refused() -> None:
    class Shampoo(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float = 0.1) -> None:
            super().__init__(params, {"lr": lr})

    with sharded_init():
        model = tiny_llama(**MODEL)
    with pytest.raises(ValueError, match="Shampoo is not known to be elementwise.*whole_tensor = True"):
        zero_shard(model, Shampoo, ZeroConfig(stage=2), lr=0.1)
    with pytest.raises(ValueError, match="MuonWithAdamW updates whole tensors.*does not compose"):
        zero_shard(model, MuonWithAdamW, ZeroConfig(stage=2), placement=LocalPlacement(),
                   param_groups=muon_param_groups(model))
    assert all(isinstance(p, ConstructedParameter) for p in model.parameters())  # refused before any work


def test_muon_group_with_vectors_is_refused_naming_the_group() -> None:
    model = build_model()
    with pytest.raises(ValueError, match="param group 0 has use_muon=True.*not 2-D"):
        MuonWithAdamW([{"params": list(model.parameters()), "use_muon": True}])
    groups = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in groups[0]["params"]}
    assert "embed_tokens.weight" not in muon and "lm_head.weight" not in muon and "norm.weight" not in muon
    assert "layers.0.attn.q_proj.weight" in muon and len(muon) == 14
