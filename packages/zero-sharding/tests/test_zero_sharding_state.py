"""State: meta-device construction, full state_dict / load_state_dict, optimizer state round trip,
the sharded-state protocol (save at one layout, load into another), the streaming safetensors
exporter, gathered parameters for generation, tied weights, parameter groups on their own group."""

from __future__ import annotations

import copy
import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import BATCH, MODEL, OPT, SEQ, build_model

from plait.kernels.collectives import ByteLedger
from plait.kernels.sharded_state import ShardedStateful
from plait.kernels.testing import global_batch, rank_slice, run_distributed, tiny_llama
from plait.zero_sharding import ZeroConfig, gathered_parameters, sharded_init, zero_shard


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, count: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + count):
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _global_from_pieces(pieces: dict) -> dict[str, torch.Tensor]:
    """Assemble whole tensors from every rank's ShardedTensors (small model: via all_gather_object)."""
    mine = {name: (st.spec, st.local.clone()) for name, st in pieces.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in everyone:
        for name, (spec, local) in rank_pieces.items():
            assert local.numel() > 0, f"{name}: empty piece"
            target = out.setdefault(name, torch.zeros(spec.global_shape, dtype=spec.dtype))
            spec.index_into(target).copy_(local.view(spec.local_shape))
    return out


def check_meta_init_and_full_state() -> None:
    reference = build_model().state_dict()
    with sharded_init(init="meta"):
        model = tiny_llama(**MODEL)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3, param_persistence_threshold=0), **OPT)
    held = sum(u.full.untyped_storage().nbytes() for u in model.zero_engine.units)
    assert held == 0, "stage 3 keeps no gathered parameters between steps"
    model.load_state_dict(reference)
    state = model.state_dict()
    assert all(v.numel() for v in state.values()), "saving never writes empty tensors"
    for name, value in reference.items():
        if name in state:
            assert torch.equal(state[name], value), name
    plain, plain_opt = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=3, param_persistence_threshold=0),
                                  **OPT)
    assert _steps(model, optimizer, 0, 3) == _steps(plain, plain_opt, 0, 3)


def check_optimizer_round_trip() -> None:
    config = ZeroConfig(stage=2, compute_dtype=torch.bfloat16)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _steps(model, optimizer, 0, 2)
    scheduler.step()
    # deepcopy: like torch's, the optimizer state dict references live state tensors.
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), scheduler.state_dict()))
    expected = _steps(model, optimizer, 2, 2)
    again, again_opt = zero_shard(build_model(seed=5), torch.optim.AdamW, config, **OPT)
    again_sched = torch.optim.lr_scheduler.StepLR(again_opt, step_size=1, gamma=0.5)
    again.load_state_dict(saved[0])
    again_opt.load_state_dict(saved[1])
    again_sched.load_state_dict(saved[2])
    assert again_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == OPT["lr"] * 0.5
    assert _steps(again, again_opt, 2, 2) == expected


def check_sharded_state_reshard() -> None:
    source, source_opt = zero_shard(build_model(), torch.optim.AdamW,
                                    ZeroConfig(stage=3, param_persistence_threshold=100), **OPT)
    _steps(source, source_opt, 0, 3)
    assert isinstance(source, ShardedStateful)
    pieces = source.sharded_state_dict()
    assert {st.spec.kind for st in pieces.values()} == {"parameter", "optimizer_state", "other"}
    whole = _global_from_pieces(pieces)
    full = source.state_dict()
    for name, value in full.items():
        if f"model.{name}" in whole:
            assert torch.equal(whole[f"model.{name}"], value), name
    # Load into a different layout: stage 2, other bucket sizes.
    target, target_opt = zero_shard(build_model(seed=9), torch.optim.AdamW,
                                    ZeroConfig(stage=2, reduce_bucket_elements=7_000), **OPT)
    target_pieces = target.sharded_state_dict()
    assert set(target_pieces) == set(pieces) or set(_global_from_pieces(target_pieces)) == set(whole)
    for name, st in target_pieces.items():
        st.local.copy_(st.spec.index_into(whole[name]).reshape(st.spec.local_shape))
    target.load_sharded_state_dict(target_pieces)
    expected = _steps(source, source_opt, 3, 2)
    got = _steps(target, target_opt, 3, 2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=0)


def check_export_and_generation(tmp: str) -> None:
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=3, param_persistence_threshold=0),
                                  **OPT)
    _steps(model, optimizer, 0, 2)
    path = Path(tmp) / "weights.safetensors"
    written = model.export_full_weights(path)
    state = model.state_dict()
    dist.barrier()
    assert (written is not None) == (dist.get_rank() == 0)
    # safetensors reads the export independently of our writer where it is installed (the full test
    # environment); plait-zero-sharding alone does not depend on it.
    if importlib.util.find_spec("safetensors"):
        from safetensors.torch import load_file

        loaded = load_file(str(path))
        assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    plain = build_model()
    plain.load_state_dict(state)
    prompt = global_batch(0, 1, 8)["input_ids"]
    with gathered_parameters(model), ByteLedger() as ledger:
        ours = model.generate(prompt, max_new_tokens=6)
    assert ledger.count("all_gather") == 0, "generation inside gathered_parameters must not gather per token"
    assert torch.equal(ours, plain.generate(prompt, max_new_tokens=6))
    with gathered_parameters(model, writeback=True), torch.no_grad():
        model.norm.weight.fill_(0.5)
    assert torch.equal(model.state_dict()["norm.weight"], torch.full_like(state["norm.weight"], 0.5))


def check_tied_and_groups() -> None:
    def tied() -> torch.nn.Module:
        m = build_model()
        m.lm_head.weight = m.embed_tokens.weight
        return m

    ref = tied()
    ref_opt = torch.optim.AdamW(ref.parameters(), **OPT)
    expected = []
    for step in range(3):
        loss = ref(**global_batch(step, BATCH, SEQ)).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(loss.item())
    model, optimizer = zero_shard(tied(), torch.optim.AdamW, ZeroConfig(stage=3, param_persistence_threshold=0), **OPT)
    got = _mean_losses(model, optimizer, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=0)
    # Norm weights on their own process group (same ranks, another group object) and options.
    plain = build_model()
    norms = [p for n, p in plain.named_parameters() if "norm" in n]
    others = [p for n, p in plain.named_parameters() if "norm" not in n]
    group = dist.new_group(list(range(dist.get_world_size())))
    model, optimizer = zero_shard(plain, torch.optim.AdamW, ZeroConfig(stage=2), param_groups=[
        {"params": others}, {"params": norms, "weight_decay": 0.0, "zero_group": group, "zero_distinct": False}],
        **OPT)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [OPT["weight_decay"], 0.0]
    assert all(u.group is group for u in model.zero_engine.units if u.option_index == 1)
    _mean_losses(model, optimizer, 2)


def _mean_losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(count):
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total)
        out.append(total.item() / world)
    return out


def check_profiler_ranges() -> None:
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=3, param_persistence_threshold=0),
                                  **OPT)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _steps(model, optimizer, 0, 1)
    names = {event.name for event in prof.events()}
    for expected in ("plait::zero::all_gather", "plait::zero::reduce_scatter", "plait::zero::wait_reduce_scatter",
                     "plait::zero::optimizer_step", "plait::zero::pre_forward", "plait::zero::pre_backward"):
        assert expected in names, (expected, sorted(n for n in names if n.startswith("plait")))
    breakdown = optimizer.last_breakdown
    assert breakdown.step_s >= breakdown.comm_wait_s + breakdown.optimizer_s >= 0


def check_activation_checkpointing() -> None:
    config = ZeroConfig(stage=3, param_persistence_threshold=0)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
    expected = _mean_losses(model, optimizer, 3)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
    for block in model.layers:
        inner = block.forward
        block.forward = lambda *args, inner=inner: torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False)
    assert _mean_losses(model, optimizer, 3) == expected


def check_clip_grad_norm_method() -> None:
    """optimizer.clip_grad_norm_(m) before step() equals ZeroConfig(max_grad_norm=m)."""
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=2, max_grad_norm=0.05), **OPT)
    expected = _mean_losses(model, optimizer, 3)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(stage=2), **OPT)
    rank, world = dist.get_rank(), dist.get_world_size()
    got, norms = [], []
    for step in range(3):
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        loss.backward()
        norms.append(optimizer.clip_grad_norm_(0.05))
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total)
        got.append(total.item() / world)
    assert got == expected and all(n > 0.05 for n in norms), (got, expected, norms)


def _rank_state(tmp: str) -> bool:
    check_clip_grad_norm_method()
    check_activation_checkpointing()
    check_profiler_ranges()
    check_meta_init_and_full_state()
    check_optimizer_round_trip()
    check_sharded_state_reshard()
    check_export_and_generation(tmp)
    check_tied_and_groups()
    return True


@pytest.mark.timeout(200)
def test_state_checkpoint_export_generation() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        assert run_distributed(_rank_state, 2, tmp, timeout=180) == [True, True]
