"""A script written for DeepSpeed runs unedited under plait's launcher: losses equal DeepSpeed's own.

One torchrun launch (W=2, gloo) per side runs the script once per config: ZeRO-2 and ZeRO-3
configs shaped like the DeepSpeed examples' (AdamW block, warmup schedule, clipping, gradient
accumulation). Under plait, ``import deepspeed`` resolves to the shim and no module of the real
DeepSpeed is loaded.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

SCRIPTS = pathlib.Path(__file__).resolve().parent / "deepspeed_scripts"
STEPS = 20
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                         "torch_adam": True}}
CONFIGS = {
    "zero2": {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0, "optimizer": OPTIMIZER,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 5}},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                              "contiguous_gradients": True},
        "steps_per_print": 2000, "wall_clock_breakdown": False,
    },
    "zero3": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": OPTIMIZER,
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 5, "total_num_steps": STEPS}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6,
                              "stage3_param_persistence_threshold": 100, "stage3_max_live_parameters": 1e9,
                              "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 2000, "wall_clock_breakdown": False,
    },
}


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp: pathlib.Path, side: str, configs: list[str]) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port())]
    if side == "plait":
        command += ["-m", "plait.zero_sharding.deepspeed"]
    else:
        env["PATCH_DS_SHM"] = "1"
    command += [str(SCRIPTS / "run_configs.py"), str(tmp / side), str(STEPS), *configs]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("ds_shim")
    paths = []
    for name, config in CONFIGS.items():
        paths.append(str(tmp / f"{name}.json"))
        pathlib.Path(paths[-1]).write_text(json.dumps(config))
    _launch(tmp, "deepspeed", paths)
    _launch(tmp, "plait", paths)
    return tmp


@pytest.mark.parametrize(("index", "name"), list(enumerate(CONFIGS)))
@pytest.mark.parametrize("rank", [0, 1])
def test_losses_equal_deepspeed_within_1e5(runs: pathlib.Path, index: int, name: str, rank: int) -> None:
    ours = json.loads((runs / f"plait.{index}.rank{rank}.json").read_text())
    theirs = json.loads((runs / f"deepspeed.{index}.rank{rank}.json").read_text())
    assert theirs["deepspeed"] == "deepspeed" and theirs["engine"] == "deepspeed.runtime.engine"
    assert ours["deepspeed"] == "plait.zero_sharding.deepspeed"
    assert ours["engine"] == "plait.zero_sharding.deepspeed.engine"
    micro_batches = STEPS * CONFIGS[name]["gradient_accumulation_steps"]
    assert len(ours["losses"]) == len(theirs["losses"]) == micro_batches
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
    # float64 shard norms on both sides; DeepSpeed stage 1/2 rounds its sum to fp32 (one ulp)
    assert ours["grad_norms"] == pytest.approx(theirs["grad_norms"], rel=3e-7)
    assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-9, abs=1e-12)
    assert (ours["global_steps"], ours["train_batch_size"]) == (theirs["global_steps"], theirs["train_batch_size"])


def test_the_real_deepspeed_is_never_loaded_under_the_launcher(runs: pathlib.Path) -> None:
    for rank in (0, 1):
        assert json.loads((runs / f"plait.modules.rank{rank}.json").read_text()) == []
        assert json.loads((runs / f"deepspeed.modules.rank{rank}.json").read_text()) != []
