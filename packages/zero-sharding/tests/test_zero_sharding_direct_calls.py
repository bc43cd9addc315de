"""Stage 3: submodules called directly and ``gathered_parameters(params, modifier_rank=...)``.

An HF Llama under ZeRO-3 at W=2 trained through ``model.model(ids)`` then ``model.lm_head(hidden)``
(the fused / tiled loss pattern) must follow one process on the whole batch: same losses, and the
same gradients (read back from an SGD step). An ordinary forward and backward must issue the
same all-gathers in the same order as before direct calls were supported.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from plait.kernels.testing import run_distributed  # noqa: E402
from plait.zero_sharding import DefaultGatherer, ZeroConfig, gathered_parameters, zero_shard  # noqa: E402
from plait.zero_sharding.ordering import module_orders  # noqa: E402

CONFIG = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=32)
LR, STEPS, SEQ = 0.5, 3, 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def _direct_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=ids).last_hidden_state
    logits = model.lm_head(hidden)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _reference(world: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process, both ranks' batches, averaged: the loss curve and each step's gradients."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        parts = [_direct_loss(model, _ids(step, r)) for r in range(world)]
        (sum(parts) / world).backward()
        losses.append([p.item() for p in parts])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


class _Recorder(DefaultGatherer):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def all_gather(self, shard, full_out, *, group, key, phase):
        self.calls.append((key, phase))
        return super().all_gather(shard, full_out, group=group, key=key, phase=phase)


def _direct_training() -> dict[str, object]:
    rank = dist.get_rank()
    reference = copy.deepcopy(_model())
    model, opt = zero_shard(_model(), torch.optim.SGD, ZeroConfig(stage=3, param_persistence_threshold=0), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        before = {n: t.clone() for n, t in model.state_dict().items()}
        loss = _direct_loss(model, _ids(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        grads.append({n: (before[n] - t) / LR for n, t in model.state_dict().items()})
    engine = model.zero_engine
    left_gathered = [u.key for u in engine.units if not u.resident and u.gathered]
    # No gradients: a direct call releases what it gathered, and the result matches unsharded code.
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        ids = _ids(99, 0)
        hidden = model.model(input_ids=ids).last_hidden_state
        released = [u.key for u in engine.units if not u.resident and u.gathered]
        want = reference.lm_head(reference.model(input_ids=ids).last_hidden_state)
        got = model.lm_head(hidden)
        x = torch.randn(2, SEQ, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(5))
        mlp_got, mlp_want = model.model.layers[1].mlp(x), reference.model.layers[1].mlp(x)
    return {"losses": losses, "grads": grads, "left_gathered": left_gathered, "released": released,
            "head": (got, want), "mlp": (mlp_got, mlp_want)}


def _all_checks() -> dict[str, object]:
    """Every W=2 check of this file in one spawn (one set of imports per rank)."""
    return {"direct": _direct_training(), "order": _gather_order(), "scoped": _scoped_gathers()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run_distributed(_all_checks, 2, timeout=300)


@pytest.fixture(scope="module")
def direct_results(results) -> list[dict[str, object]]:
    return [res["direct"] for res in results]


def test_direct_submodule_calls_train_like_one_process(direct_results):
    losses, grads = _reference(2)
    for rank, res in enumerate(direct_results):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor([step[rank] for step in losses]),
                                   rtol=1e-5, atol=1e-6)
        for step in range(STEPS):
            for name, want in grads[step].items():
                torch.testing.assert_close(res["grads"][step][name], want, rtol=1e-4, atol=2e-5,
                                           msg=lambda m, n=name, s=step: f"step {s} grad of {n}: {m}")
        assert res["left_gathered"] == []  # backward's end released what the direct calls gathered


def test_direct_call_without_grad_releases_and_matches(direct_results):
    for res in direct_results:
        assert res["released"] == []
        torch.testing.assert_close(*res["head"])
        torch.testing.assert_close(*res["mlp"])  # a module inside a layer's group, called alone


def _gather_order() -> dict[str, object]:
    recorder = _Recorder()
    model, _ = zero_shard(_model(), torch.optim.SGD, ZeroConfig(stage=3, param_persistence_threshold=0),
                          gatherer=recorder, lr=LR)
    engine = model.zero_engine
    forward, backward = module_orders(model, list(engine.partition.module_units))
    keys = lambda modules: [u.key for m in modules for u in engine.partition.module_units[m]]  # noqa: E731
    ids = _ids(0, dist.get_rank())
    model(input_ids=ids, labels=ids).loss.backward()
    return {"calls": recorder.calls, "root": [u.key for u in engine.partition.root_units],
            "forward": keys(forward), "backward": keys(backward)}


def test_ordinary_forward_keeps_its_gather_order(results):
    for res in (r["order"] for r in results):
        fwd = [k for k, phase in res["calls"] if phase == "forward"]
        bwd = [k for k, phase in res["calls"] if phase == "backward"]
        assert fwd == res["root"] + res["forward"]  # root first, then every group once, prefetched in order
        assert bwd == res["backward"]


def _scoped_gathers() -> dict[str, object]:
    rank = dist.get_rank()
    reference = _model()
    model, _ = zero_shard(_model(), torch.optim.SGD, ZeroConfig(stage=3, param_persistence_threshold=0), lr=LR)
    weight = model.lm_head.weight
    out: dict[str, object] = {"sharded_bytes": weight.untyped_storage().nbytes()}
    with gathered_parameters(weight):
        out["read"] = torch.equal(weight, reference.lm_head.weight)
        with torch.no_grad():
            weight.add_(1.0)  # dropped: read-only scope
    with gathered_parameters([weight], enabled=False):
        out["disabled_bytes"] = weight.untyped_storage().nbytes()
    plain = torch.nn.Parameter(torch.ones(3))
    with gathered_parameters([plain], modifier_rank=0):
        plain.data.mul_(2)  # not managed by ZeRO: untouched by the scope
    out["plain"] = plain.detach().clone()
    out["after_read"] = torch.equal(model.state_dict()["lm_head.weight"], reference.lm_head.weight)
    with gathered_parameters(list(model.model.norm.parameters()) + [weight], modifier_rank=0), torch.no_grad():
        weight.mul_(2.0 if rank == 0 else 7.0)  # only rank 0's edit is kept
        model.model.norm.weight.fill_(3.0 + rank)
    state = model.state_dict()
    out["modified"] = torch.equal(state["lm_head.weight"], reference.lm_head.weight * 2.0)
    out["norm"] = torch.equal(state["model.norm.weight"], torch.full_like(state["model.norm.weight"], 3.0))
    out["bytes_after"] = weight.untyped_storage().nbytes()
    with pytest.raises(ValueError, match="modifier_rank=2"):
        gathered_parameters([weight], modifier_rank=2)
    with pytest.raises(TypeError, match="not sharded"):
        gathered_parameters(reference)
    return out


def test_gathered_parameters_read_and_modify(results):
    for res in (r["scoped"] for r in results):
        assert res["sharded_bytes"] == 0 and res["disabled_bytes"] == 0 and res["bytes_after"] == 0
        assert res["read"] and res["after_read"], "a read-only scope must show the weights and drop edits"
        assert res["modified"] and res["norm"], "modifier_rank=0's edits must reach every rank's shard"
        assert torch.equal(res["plain"], torch.full((3,), 2.0))
