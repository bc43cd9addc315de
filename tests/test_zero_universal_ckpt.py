"""Real producers: plait.zero_sharding ZeRO-1/2/3 models saved at one layout and loaded at another.

plait-universal-ckpt never imports plait.zero_sharding (it reads any producer through the sharded
state protocol of plait.kernels), so this test of the two together lives in the top-level suite.
"""

from __future__ import annotations

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.universal_ckpt.testing import small_model


def _zero_model(stage: int, seed: int):
    from plait.zero_sharding import ZeroConfig, zero_shard

    model = small_model(seed)
    return zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage), lr=1e-3)


def _train(model, optim, steps: range) -> list[float]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in steps:
        batch = rank_slice(global_batch(step, 12, 16), rank, world)
        loss = model(batch["input_ids"], batch["labels"]).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def save_zero(root: str, stage: int) -> None:
    model, optim = _zero_model(stage, 0)
    _train(model, optim, range(2))
    uc.save({"model": model, "rng": uc.RNGState()}, root, step=2, layout={"zero_stage": stage})


def load_zero_resave(src: str, dst: str, stage: int) -> list[float]:
    model, optim = _zero_model(stage, 5)
    _train(model, optim, range(1))  # optimizer state exists and differs: the load must replace it
    uc.load({"model": model, "rng": uc.RNGState()}, src)
    uc.save({"model": model}, dst, step=2, layout={"zero_stage": stage})
    return _train(model, optim, range(2, 3))


def _consolidated(root, prefix: str = "model/") -> dict[str, torch.Tensor]:
    ckpt = uc.latest(root)
    manifest = uc.read_manifest(ckpt)
    return {n: uc.read_full(ckpt, manifest, e) for n, e in manifest.tensors.items() if n.startswith(prefix)}


@pytest.mark.parametrize(("save_stage", "save_world", "load_stage", "load_world"), [
    (3, 4, 1, 2),
    pytest.param(1, 2, 3, 3, marks=pytest.mark.slow),
    pytest.param(2, 4, 2, 1, marks=pytest.mark.slow),
])
def test_zero_reshard(tmp_path, save_stage, save_world, load_stage, load_world):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    run_distributed(save_zero, save_world, src, save_stage, timeout=150)
    manifest = uc.read_manifest(uc.latest(src))
    assert manifest.layout.zero_stage == save_stage and manifest.layout.world_size == save_world
    assert any(e.kind == "optimizer_state" for e in manifest.tensors.values())
    run_distributed(load_zero_resave, load_world, src, dst, load_stage, timeout=150)
    before, after = _consolidated(src), _consolidated(dst)
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def _whole_tensor_model(stage: int, seed: int, optimizer: str):
    from plait.zero_sharding import MuonWithAdamW, ZeroConfig, muon_param_groups, zero_shard

    model = small_model(seed)
    if optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return zero_shard(model, Adafactor, ZeroConfig(stage=stage), lr=1e-3, relative_step=False,
                          scale_parameter=False, warmup_init=False)
    return zero_shard(model, MuonWithAdamW, ZeroConfig(stage=stage), param_groups=muon_param_groups(model),
                      lr=0.02, adamw_lr=1e-3)


def save_whole_tensor(root: str, stage: int, optimizer: str) -> None:
    model, optim = _whole_tensor_model(stage, 0, optimizer)
    _train(model, optim, range(2))
    uc.save({"model": model}, root, step=2, layout={"zero_stage": stage})


def load_whole_tensor_resave(src: str, dst: str, stage: int, optimizer: str) -> None:
    model, optim = _whole_tensor_model(stage, 5, optimizer)
    _train(model, optim, range(1))  # every owner has state, and it differs: the load must replace it
    uc.load({"model": model}, src)
    uc.save({"model": model}, dst, step=2, layout={"zero_stage": stage})


# optimizer -> (save stage, load stage, state names the checkpoint must hold)
WHOLE_TENSOR = {
    "muon": (2, 3, (".momentum_buffer.", ".exp_avg.")),
    # Adafactor's factored second moments (row and column vectors of each matrix) and its step,
    # a Python int in the optimizer state.
    "adafactor": (1, 3, (".exp_avg_sq_row.", ".exp_avg_sq_col.", ".exp_avg_sq.", "optim.step.")),
}


@pytest.mark.parametrize("optimizer", list(WHOLE_TENSOR))
def test_whole_tensor_optimizer_state_reshards_by_global_name(tmp_path, optimizer):
    """Muon + AdamW saved under ZeRO-2 at W=2, Adafactor under ZeRO-1 at W=2 (each tensor's state
    whole on its owner), loaded under ZeRO-3 at W=3 (other owners): every piece, Muon's momentum,
    AdamW's moments, Adafactor's factored moments and step counters included, comes back bit for
    bit."""
    if optimizer == "adafactor":
        pytest.importorskip("transformers")
    save_stage, load_stage, expected = WHOLE_TENSOR[optimizer]
    src = str(tmp_path / "src")
    run_distributed(save_whole_tensor, 2, src, save_stage, optimizer, timeout=150)
    before = _consolidated(src)
    for part in expected:
        assert any(part in name for name in before), part
    for world in (3,):
        dst = str(tmp_path / f"dst{world}")
        run_distributed(load_whole_tensor_resave, world, src, dst, load_stage, optimizer, timeout=150)
        after = _consolidated(dst)
        assert sorted(before) == sorted(after)
        for name in before:
            assert torch.equal(before[name], after[name]), (world, name)
    if optimizer == "adafactor":
        steps = {name: int(value) for name, value in before.items() if "optim.step." in name}
        assert set(steps.values()) == {2}, steps


def _plait_ckpt(*argv: str) -> int:
    from plait.kernels.cli.main import main

    return main(["ckpt", *argv])


def test_hf_export_of_zero_and_dcp_sources_loads_into_the_module(tmp_path):
    """ZeRO-3 at W=2 -> HF export (directly, and through DCP) -> the original module, strict=True."""
    from safetensors.torch import load_file

    src = tmp_path / "zero"
    run_distributed(save_zero, 2, str(src), 3, timeout=150)
    assert _plait_ckpt("convert", str(src), str(tmp_path / "dcp"), "--to", "dcp") == 0
    masters = {name.removeprefix("model/model."): tensor for name, tensor in _consolidated(src, "model/model.").items()}
    for source in (src, tmp_path / "dcp"):
        out = tmp_path / f"hf-{source.name}"
        assert _plait_ckpt("convert", str(source), str(out), "--to", "hf") == 0
        weights = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        module = small_model(1)
        module.load_state_dict(weights, strict=True)  # the model's own names, every one of them
        assert all(torch.equal(module.state_dict()[name], masters[name]) for name in masters)
        assert sorted(masters) == sorted(name for name, _ in module.named_parameters())
