"""Import real DeepSpeed ZeRO-1/2/3 checkpoints (written here on CPU by deepspeed itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.interop.deepspeed import import_deepspeed
from plait.universal_ckpt.interop.hf import export_hf

# fp16 is refused by DeepSpeed's CPU accelerator ("Type fp16 is not supported on your device"),
# so the low-precision variant tested on CPU is bf16; the importer reads fp16 runs the same way
# (the fp32 partitions and moments are stored alike).
CONFIGS = [(1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp32"), (3, "fp32")]


def make_deepspeed_checkpoints(root: str, configs: list[tuple[int, str]]) -> bool:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator JIT-compiles a shared-memory all-reduce on init; gloo needs none of it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    for stage, dtype in configs:
        torch.manual_seed(0)
        model = _sequential()
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=config)
        for _ in range(2):
            x = torch.randn(2, 8, dtype=engine.module[0].weight.dtype)
            engine.backward(engine(x).float().square().mean())
            engine.step()
        engine.save_checkpoint(f"{root}/ds_{stage}_{dtype}", tag="step2",
                               client_state={"universal_checkpoint_info": {}})
    return True


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("ds")
    run_distributed(make_deepspeed_checkpoints, 2, str(root), CONFIGS, timeout=240,
                    env={"DS_ACCELERATOR": "cpu"})
    return root


@pytest.mark.parametrize(("stage", "dtype"), CONFIGS)
def test_import_matches_deepspeed_fp32_weights(ds_root, tmp_path, stage, dtype):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = ds_root / f"ds_{stage}_{dtype}"
    ckpt = import_deepspeed(src, tmp_path / "uc")
    manifest = uc.verify_checkpoint(ckpt)
    assert manifest.step == 2 and manifest.layout.zero_stage == stage and manifest.layout.world_size == 2
    reference = get_fp32_state_dict_from_zero_checkpoint(str(src))
    for name, tensor in reference.items():
        ours = uc.read_full(ckpt, manifest, manifest.tensors[f"model/model.{name}"])
        assert ours.dtype == torch.float32 and torch.equal(ours, tensor), name
        for field in ("exp_avg", "exp_avg_sq"):
            moment = uc.read_full(ckpt, manifest, manifest.tensors[f"model/optim.{field}.{name}"])
            assert moment.shape == tensor.shape and torch.isfinite(moment).all()
    assert float(uc.read_full(ckpt, manifest, manifest.tensors["model/optim.step.0.weight"])) == 2.0
    # The HF export carries the model's own names: it loads into the original module, strict.
    _assert_export_loads(export_hf(ckpt, tmp_path / "hf"), reference)


def _sequential() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def _assert_export_loads(hf_dir, reference: dict[str, torch.Tensor]) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file
    weights = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    module = _sequential()
    module.load_state_dict(weights, strict=True)
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("route", ["direct", "through universal"])
def test_ckpt_convert_deepspeed_to_hf_keeps_model_names(ds_root, tmp_path, route):
    """`plait ckpt convert <deepspeed dir> out --to hf`, directly or via --to universal first."""
    import argparse

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from plait.universal_ckpt.cli import register

    def plait(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="plait")
        register(parser.add_subparsers(dest="command"))
        args = parser.parse_args(list(argv))
        return args.func(args)

    src = ds_root / "ds_3_bf16"
    if route == "direct":
        assert plait("ckpt", "convert", str(src), str(tmp_path / "hf"), "--to", "hf") == 0
    else:
        assert plait("ckpt", "convert", str(src), str(tmp_path / "uc"), "--to", "universal") == 0
        assert plait("ckpt", "convert", str(tmp_path / "uc"), str(tmp_path / "hf"), "--to", "hf") == 0
    _assert_export_loads(tmp_path / "hf", get_fp32_state_dict_from_zero_checkpoint(str(src)))


def test_moments_match_ds_to_universal(ds_root, tmp_path):
    """DeepSpeed's own offline converter (ZeRO-1/2) must agree with our import, moments included."""
    src = ds_root / "ds_2_fp32"
    out = tmp_path / "ds_universal"
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(src / "step2"), "--output_folder", str(out), "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = import_deepspeed(src, tmp_path / "uc")
    manifest = uc.read_manifest(ckpt)
    compared = 0
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        for field, ours_name in (("fp32", f"model.{name}"), ("exp_avg", f"optim.exp_avg.{name}"),
                                 ("exp_avg_sq", f"optim.exp_avg_sq.{name}")):
            theirs = torch.load(out / "zero" / name / f"{field}.pt", weights_only=False)["param"]
            ours = uc.read_full(ckpt, manifest, manifest.tensors[f"model/{ours_name}"])
            assert torch.equal(ours, theirs), (name, field)
            compared += 1
    assert compared == 12


def test_not_a_deepspeed_checkpoint(tmp_path):
    with pytest.raises(uc.CheckpointNotFoundError):
        import_deepspeed(tmp_path, tmp_path / "out")
