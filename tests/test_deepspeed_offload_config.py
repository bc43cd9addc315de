"""A DeepSpeed config that offloads runs on plait: its offload keys become plait-offload-io's settings.

plait-zero-sharding's translator refuses the offload and ``aio`` keys on its own; plait-offload-io
registers them through the ``plait.deepspeed_keys`` entry point. Checked here: the mapping of each
key, the refusals (named by their dotted path), every route that reads a ``ds_config`` (the
``deepspeed.initialize`` shim, Lightning's ``from_deepspeed``, the HF Trainer's ``--deepspeed``), and
the ZeRO-3 + CPU offload and ZeRO-2 + CPU offload configs of the DeepSpeed/HF examples run by the
same unedited script under DeepSpeed 0.19.8 and under plait's launcher: losses, gradient norms and
learning rates within 1e-5; and an unedited HF Trainer script given the HF docs' ZeRO-3 file with its
CPU offload blocks (``--deepspeed``, through ``plait.transformers.launch``) trains on the offload
placement with the losses of the same file without them.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytest.importorskip("plait.offload_io")
from plait.offload_io import IOConfig, OffloadConfig
from plait.zero_sharding.deepspeed.config import translate
from plait.zero_sharding.deepspeed.keys import load_package_keys, lookup

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "packages" / "zero-sharding" / "tests" / "deepspeed_scripts"
STEPS = 20
# The ZeRO-3 + CPU offload config of DeepSpeed's and HF's examples (ds_config_zero3.json), with the
# optimizer and scheduler blocks the shim test uses; torch's AdamW on both sides (DeepSpeed's own
# CPU Adam is a C++ build; zero_force_ds_cpu_optimizer=false lets DeepSpeed offload torch's).
ZERO3_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 5, "total_num_steps": STEPS}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6,
        "stage3_param_persistence_threshold": 100, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2000, "wall_clock_breakdown": False,
}

# The ZeRO-2 + CPU optimizer offload config of the same examples (ds_config_zero2.json).
ZERO2_OFFLOAD = {**ZERO3_OFFLOAD, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
    "contiguous_gradients": True}}


def _with(zero: dict, **top) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, **top}
    return config


def test_the_offload_keys_are_registered_by_plait_offload_io() -> None:
    assert "offload-io" in load_package_keys()
    for path in ("zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.nvme_path",
                 "zero_optimization.sub_group_size", "aio.block_size"):
        assert lookup(path).owner == "plait-offload-io" and lookup(path).action == "mapped", path


def test_zero3_cpu_offload_config_maps_to_offload_config() -> None:
    plan = translate(ZERO3_OFFLOAD, world_size=2)
    assert plan.extensions["offload"] == OffloadConfig(device="cpu", param_device="cpu", sub_group_size=10**9)
    assert plan.zero.stage == 3


def test_nvme_config_maps_path_buffers_pipelining_and_aio(tmp_path) -> None:
    zero = {"stage": 3, "sub_group_size": 4096,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4, "ratio": 0.5,
                                  "pipeline_read": False, "pipeline_write": False, "fast_init": False},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5, "buffer_size": 1e8,
                              "max_in_cpu": 1e9}}
    aio = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2, "single_submit": False,
           "overlap_events": True, "use_gds": False}
    plan = translate(_with(zero, aio=aio), world_size=1)
    assert plan.extensions["offload"] == OffloadConfig(
        device="nvme", param_device="nvme", path=str(tmp_path), sub_group_size=4096, slots=4, offload_ratio=0.5,
        overlap_io=False, io=IOConfig(block_size=1 << 20, queue_depth=8, workers=2))


def test_offloading_nothing_gives_no_extension() -> None:
    plan = translate(_with({"stage": 3, "offload_optimizer": {"device": "none"}, "sub_group_size": 1e9}),
                     world_size=1)
    assert "offload" not in plan.extensions


@pytest.mark.parametrize(("zero", "top", "named"), [
    ({"stage": 3, "offload_param": {"device": "cpu"}}, {}, "zero_optimization.offload_param.device='cpu' without"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, {}, "zero_optimization.stage=1"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, {},
     "parameters are partitioned (and so offloadable) at stage 3 only"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
      "offload_param": {"device": "nvme", "nvme_path": "/b"}}, {}, "differ"),
    ({"stage": 3, "offload_optimizer": {"device": "gpu"}}, {}, "zero_optimization.offload_optimizer.device='gpu'"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "colour": 1}}, {},
     "zero_optimization.offload_optimizer.colour"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"}}, {"aio": {"use_gds": True}},
     "aio.use_gds"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"}},
     {"aio": {"queue_depth": 1, "thread_count": 4}}, "queue_depth"),
])
def test_settings_plait_cannot_run_are_refused_by_name(zero: dict, top: dict, named: str) -> None:
    with pytest.raises(ValueError) as info:
        translate(_with(zero, **top), world_size=1)
    assert named in str(info.value)


def test_lightning_from_deepspeed_takes_the_offload_settings() -> None:
    pytest.importorskip("lightning")
    from plait.lightning.deepspeed_config import strategy_kwargs

    config = copy.deepcopy(ZERO3_OFFLOAD)
    del config["optimizer"], config["scheduler"]
    kwargs = strategy_kwargs(config)
    assert kwargs["offload"] == OffloadConfig(device="cpu", param_device="cpu", sub_group_size=10**9)
    assert kwargs["zero"].stage == 3


def test_hf_trainer_deepspeed_route_takes_the_offload_settings(tmp_path) -> None:
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from plait.transformers.ds_route import plan_for

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_grad_norm=1.0,
                             learning_rate=1e-3, weight_decay=0.01, warmup_steps=5, report_to=[])
    config, _ = plan_for(ZERO3_OFFLOAD, args, world_size=2, num_training_steps=STEPS)
    assert config.offload == OffloadConfig(device="cpu", param_device="cpu", sub_group_size=10**9)
    assert type(config.placement()).__name__ == "ZeroOffloadPlacement"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp: pathlib.Path, side: str, *configs: pathlib.Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port())]
    if side == "plait":
        command += ["-m", "plait.zero_sharding.deepspeed"]
    else:
        env["PATCH_DS_SHM"] = "1"
    command += [str(SCRIPTS / "run_configs.py"), str(tmp / side), str(STEPS), *map(str, configs)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def test_zero3_and_zero2_cpu_offload_scripts_match_deepspeed(tmp_path) -> None:
    pytest.importorskip("deepspeed")
    configs = []
    for name, config in (("zero3_offload", ZERO3_OFFLOAD), ("zero2_offload", ZERO2_OFFLOAD)):
        configs.append(tmp_path / f"{name}.json")
        configs[-1].write_text(json.dumps(config))
    _launch(tmp_path, "deepspeed", *configs)  # one launch per side runs both configs
    _launch(tmp_path, "plait", *configs)
    for index, rank in ((index, rank) for index in range(len(configs)) for rank in (0, 1)):
        ours = json.loads((tmp_path / f"plait.{index}.rank{rank}.json").read_text())
        theirs = json.loads((tmp_path / f"deepspeed.{index}.rank{rank}.json").read_text())
        assert ours["engine"] == "plait.zero_sharding.deepspeed.engine"
        assert theirs["engine"] == "deepspeed.runtime.engine"
        assert ours["placement"] == "ZeroOffloadPlacement", configs[index].name
        assert len(ours["losses"]) == len(theirs["losses"]) == STEPS
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5), configs[index].name
        assert ours["grad_norms"] == pytest.approx(theirs["grad_norms"], rel=1e-5), configs[index].name
        assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-9, abs=1e-12)


ROUTE_TESTS = pathlib.Path(__file__).resolve().parents[1] / "integrations" / "transformers" / "tests"


def _hf_offload_session(tmp: str) -> dict:
    """The DeepSpeed user's unedited HF Trainer script through plait's launcher with the HF docs'
    ZeRO-3 file, without and with its CPU offload blocks; counts the offload placements built."""
    sys.path.insert(0, str(ROUTE_TESTS))
    import importlib

    from test_transformers_deepspeed_route import SCRIPT, ZERO3, _run

    zero_placement = importlib.import_module("plait.offload_io.zero_placement")  # the module, not the function
    built = []
    original = zero_placement.ZeroOffloadPlacement.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    zero_placement.ZeroOffloadPlacement.__init__ = counting
    root = pathlib.Path(tmp)
    (root / "train.py").write_text(SCRIPT)
    offload = copy.deepcopy(ZERO3)
    offload["zero_optimization"].update(offload_optimizer={"device": "cpu", "pin_memory": True},
                                        offload_param={"device": "cpu", "pin_memory": True})
    plain = _run(root, "zero3", "launch", ZERO3)
    before = len(built)
    offloaded = _run(root, "zero3_offload", "launch", offload)
    return {"plain": plain, "offloaded": offloaded, "placements": (before, len(built))}


def test_hf_trainer_script_with_the_zero3_offload_file_trains_offloaded(tmp_path) -> None:
    pytest.importorskip("plait.transformers")
    from plait.kernels.testing import run_distributed

    out = run_distributed(_hf_offload_session, 2, str(tmp_path), timeout=600)[0]
    assert out["placements"][0] == 0 and out["placements"][1] >= 1  # the offload ran only where the file asked
    assert len(out["offloaded"]) == len(out["plain"]) == 4
    # CPU offload moves where the optimizer state lives, not what it computes.
    assert out["offloaded"] == pytest.approx(out["plain"], rel=1e-6)


def test_offload_io_readme_has_the_key_table() -> None:
    from plait.offload_io.deepspeed_keys import key_rows
    from plait.zero_sharding.deepspeed.keys import key_table_markdown

    readme = (pathlib.Path(__file__).resolve().parents[1] / "packages" / "offload-io" / "README.md").read_text()
    table = readme.split("<!-- deepspeed-offload-keys:start -->\n")[1].split("<!-- deepspeed-offload-keys:end -->")[0]
    assert table == key_table_markdown(key_rows()), "regenerate the table between the deepspeed-offload-keys markers"
