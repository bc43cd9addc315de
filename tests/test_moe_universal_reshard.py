"""An expert-parallel MoE model under ZeRO resharded across ep sizes through universal checkpoints
(cross-package: plait-moe-layers + plait-zero-sharding + plait-universal-ckpt).

tiny-llama-MoE with plait MoE layers (4 experts, stacked gated MLPs) trains 2 AdamW steps under
ZeRO-3 at W=4 with ``dp=2 x ep=2`` (each rank 2 of the 4 experts, sharded over its expert-data-
parallel pair), its parameter groups from ``zero_param_groups`` (experts named by their global
rows). The checkpoint holds every expert under its global name and shape; it loads into a
differently initialised model at ``ep=1`` (W=2 ZeRO-2, W=1) and at ``ep=4`` (W=4, ZeRO-3): the loaded
model's full state equals the saved one exactly, and 2 more steps give the source run's losses
(the global-batch mean; within the fp32 summation-order tolerance: the per-rank slices differ).
The same for a MoE layer of user expert modules (``ModuleExperts``), whose experts are whole
modules renamed by their global index rather than rows of a stacked tensor.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("plait.zero_sharding")
pytest.importorskip("plait.universal_ckpt")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe_zero import BATCH, LR, SEQ, _model

import plait.universal_ckpt as uc
from plait.kernels.testing import global_batch, run_distributed, train_losses
from plait.kernels.tolerances import tolerance
from plait.moe_layers import (
    apply_expert_parallel,
    expert_global_identity,
    expert_parameters,
    make_expert_parallel_groups,
    zero_param_groups,
)
from plait.zero_sharding import ZeroConfig, zero_shard

SAVE_AT, MORE = 2, 2


def _build(stage: int, ep_size: int, *, perturb: bool = False) -> tuple:
    model = _model()
    if perturb:  # a different start, so every tensor must come from the checkpoint
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    groups = make_expert_parallel_groups(ep_size)
    apply_expert_parallel(model, groups)
    return zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage), lr=LR,
                      param_groups=zero_param_groups(model, groups))


def _global_mean(losses: list[float]) -> list[float]:
    """Per step, the mean over ranks of the slice losses: the global batch's loss (equal slices)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    return [sum(rank[step] for rank in everyone) / len(everyone) for step in range(len(losses))]


def save_worker(root: str, export: str) -> dict:
    model, optimizer = _build(3, 2)
    train_losses(model, optimizer, SAVE_AT, batch=BATCH, seq=SEQ)
    uc.save({"model": model}, root, step=SAVE_AT)
    state = model.state_dict()
    model.export_full_weights(export)
    losses = _global_mean(train_losses(model, optimizer, MORE, batch=BATCH, seq=SEQ, start=SAVE_AT))
    return {"state": state, "losses": losses} if dist.get_rank() == 0 else {}


def load_worker(root: str, stage: int, ep_size: int) -> dict:
    model, optimizer = _build(stage, ep_size, perturb=True)
    before = model.state_dict()
    uc.load({"model": model}, root)
    state = model.state_dict()
    losses = _global_mean(train_losses(model, optimizer, MORE, batch=BATCH, seq=SEQ, start=SAVE_AT))
    return {"before": before, "state": state, "losses": losses} if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict, dict]:
    tmp = tmp_path_factory.mktemp("moe_reshard")
    root, export = str(tmp / "ckpt"), str(tmp / "export.safetensors")
    source = run_distributed(save_worker, 4, root, export, timeout=240)[0]
    from safetensors.torch import load_file

    return root, source, load_file(export)


def test_checkpoint_holds_every_expert_under_its_global_name(saved) -> None:
    root, source, exported = saved
    whole = {name for name, _ in _model().named_parameters()}  # the one-process model's names
    assert set(exported) == whole and set(source["state"]) >= whole
    ckpt = uc.latest(root)
    manifest = uc.read_manifest(ckpt)
    for name, entry in manifest.tensors.items():
        if name.startswith("model/model.") and ".experts." in name:
            key = name.removeprefix("model/model.")
            assert tuple(entry.global_shape) == tuple(exported[key].shape), name
            torch.testing.assert_close(uc.read_full(ckpt, manifest, entry), exported[key], rtol=0, atol=0)
    experts = [n for n in exported if ".experts." in n]
    assert experts and all(exported[n].shape[0] == 4 for n in experts)  # all 4 experts, global rows
    for name in whole:
        assert torch.equal(source["state"][name], exported[name]), name


@pytest.mark.parametrize(("world", "stage", "ep_size"), [(2, 2, 1), (1, 3, 1), (4, 3, 4)])
def test_ep2_checkpoint_loads_at_another_ep_and_training_continues(saved, world, stage, ep_size) -> None:
    root, source, _ = saved
    target = run_distributed(load_worker, world, root, stage, ep_size, timeout=240)[0]
    experts = [n for n in source["state"] if ".experts." in n]
    assert experts and any(not torch.equal(target["before"][n], source["state"][n]) for n in experts)
    assert sorted(target["state"]) == sorted(source["state"])
    for name, value in source["state"].items():
        assert torch.equal(target["state"][name], value), name
    tol = tolerance("moe_expert_parallel", torch.float32)
    torch.testing.assert_close(torch.tensor(target["losses"]), torch.tensor(source["losses"]),
                               atol=tol.atol, rtol=tol.rtol)


H, E = 16, 4


class ModuleMoE(torch.nn.Module):
    """A regression model around a MoE layer of user expert modules (``ModuleExperts``: experts
    named ``experts.experts.<i>``, renamed ``<first + i>`` under EP)."""

    def __init__(self) -> None:
        super().__init__()
        from plait.moe_layers import MoE, MoEConfig

        self.embed = torch.nn.Linear(8, H)
        self.moe = MoE(MoEConfig(hidden_size=H, num_experts=E, intermediate_size=24, top_k=2),
                       experts=[torch.nn.Sequential(torch.nn.Linear(H, 24), torch.nn.GELU(), torch.nn.Linear(24, H))
                                for _ in range(E)])
        self.head = torch.nn.Linear(H, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.head(self.moe(self.embed(x))).squeeze(-1) - y).square().mean()


def _module_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (16 rows) sliced to this rank."""
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 8, generator=generator), torch.randn(16, generator=generator)
    rows = 16 // dist.get_world_size()
    start = dist.get_rank() * rows
    return x[start:start + rows], y[start:start + rows]


def _module_model(stage: int, ep_size: int, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = ModuleMoE()
    groups = make_expert_parallel_groups(ep_size)
    apply_expert_parallel(model, groups)
    return zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage, param_persistence_threshold=0), lr=LR,
                      param_groups=zero_param_groups(model, groups))


def _module_train(model, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*_module_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return _global_mean(losses)


def module_save_worker(root: str) -> dict:
    model, optimizer = _module_model(3, 2, 0)
    _module_train(model, optimizer, range(SAVE_AT))
    uc.save({"model": model}, root, step=SAVE_AT)
    state = model.state_dict()
    losses = _module_train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE))
    return {"state": state, "losses": losses} if dist.get_rank() == 0 else {}


def module_load_worker(root: str, stage: int, ep_size: int) -> dict:
    model, optimizer = _module_model(stage, ep_size, 5)
    uc.load({"model": model}, root)
    state = model.state_dict()
    losses = _module_train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE))
    return {"state": state, "losses": losses} if dist.get_rank() == 0 else {}


def test_user_expert_modules_reshard_by_global_index(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    source = run_distributed(module_save_worker, 4, root, timeout=240)[0]
    torch.manual_seed(0)
    assert sorted(source["state"]) == sorted(ModuleMoE().state_dict())  # experts.experts.0-3, whole model
    tol = tolerance("moe_expert_parallel", torch.float32)
    for world, stage, ep_size in ((2, 2, 1), (4, 3, 4)):
        target = run_distributed(module_load_worker, world, root, stage, ep_size, timeout=240)[0]
        assert sorted(target["state"]) == sorted(source["state"])
        for name, value in source["state"].items():
            assert torch.equal(target["state"][name], value), (ep_size, name)
        torch.testing.assert_close(torch.tensor(target["losses"]), torch.tensor(source["losses"]),
                                   atol=tol.atol, rtol=tol.rtol, msg=lambda m, e=ep_size: f"ep={e}: {m}")


def _by_hand(name: str, value: torch.Tensor, rank: int, per_rank: int) -> tuple[str, torch.Tensor]:
    """A rank's local tensor under its one-process name, worked out by hand (the oracle)."""
    module = re.fullmatch(r"(.*\.experts\.experts\.)(\d+)(\..*)", name)
    if module:
        return f"{module.group(1)}{rank * per_rank + int(module.group(2))}{module.group(3)}", value
    return name, value


def language_save_worker(root: str) -> dict:
    """ep=2 at W=2 without ZeRO, torch AdamW, one step: tiny-llama-MoE (stacked experts) and a
    ModuleExperts model saved through ``uc.model_parallel`` with configs built from moe-layers' own
    ``expert_global_identity``; the state each rank holds, for the oracle."""
    groups = make_expert_parallel_groups(2)
    out, state = {}, {}
    for key, model in (("llama", _model()), ("module", _seeded(ModuleMoE, 0))):
        apply_expert_parallel(model, groups)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loss = model(**global_batch(0, BATCH, SEQ)).loss if key == "llama" else model(*_full_module_batch())
        loss.backward()
        optimizer.step()
        config = uc.global_identity_config(model, expert_parameters(model), expert_global_identity(model),
                                           group="ep", ranks=(0, 1))
        state[key] = uc.model_parallel(model, optimizer, config=config)
        out[key] = {"model": dict(_by_hand(n, p.detach().clone(), dist.get_rank(), E // 2)
                                  for n, p in model.named_parameters()),
                    "exp_avg": dict(_by_hand(n, optimizer.state[p]["exp_avg"].clone(), dist.get_rank(), E // 2)
                                    for n, p in model.named_parameters())}
    uc.save(state, root, step=1)
    return out


def _seeded(cls, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls()


def _full_module_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100)
    return torch.randn(16, 8, generator=generator), torch.randn(16, generator=generator)


def test_expert_layout_in_the_model_parallel_language(tmp_path) -> None:
    """plait-moe-layers' expert layout in the checkpoint's layout language: stacked experts are
    ``ep:dim0`` (rows of the one-process tensor), ModuleExperts ``ep:owned`` under their global index;
    an ep=2 checkpoint loads into one process (ep=1), every weight and moment bitwise the ranks'."""
    root = tmp_path / "ckpt"
    ranks = run_distributed(language_save_worker, 2, str(root), timeout=240)
    manifest = uc.read_manifest(uc.latest(root))
    assert manifest.layout.expert_parallel_size == 2
    patterns = {name: entry.pattern for name, entry in manifest.tensors.items()}
    stacked = [n for n in patterns if n.startswith("llama/model.") and n.endswith("experts.gate_up_proj")]
    assert stacked and all(patterns[n] == {"dim": 0, "group": "ep"} for n in stacked)
    for index in range(E):  # rank 0's keep their names, rank 1's are renamed: all owned
        assert patterns[f"module/model.moe.experts.experts.{index}.0.weight"] == {"dim": None, "group": "ep",
                                                                                   "owned": True}
    assert patterns["module/model.embed.weight"] == {"dim": None, "group": "ep"}  # replicated over ep
    for key, build in (("llama", _model), ("module", lambda: _seeded(ModuleMoE, 5))):
        model = build()
        with torch.no_grad():  # another start: every value must come from the checkpoint
            for param in model.parameters():
                param.add_(1.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        uc.load({key: uc.model_parallel(model, optimizer)}, root)
        for name, param in model.named_parameters():
            for field, value in (("model", param.detach()), ("exp_avg", optimizer.state[param]["exp_avg"])):
                held = [rank[key][field][name] for rank in ranks if name in rank[key][field]]
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # each rank's rows
                    expected = torch.cat(held)
                else:  # dense (the lowest rank's copy) or one rank's whole expert
                    expected = held[0]
                assert torch.equal(value, expected), (key, field, name)
