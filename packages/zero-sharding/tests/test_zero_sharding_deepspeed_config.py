"""The ds_config translator: the shipped HF/DeepSpeed example configs, every refusal, "auto" as HF resolves it."""

import base64
import importlib.util
import json
import pathlib

import pytest
import torch

from plait.zero_sharding.deepspeed.config import batch_sizes, hf_auto_values, load_config, translate
from plait.zero_sharding.deepspeed.keys import KEYS, key_table_markdown

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# Shaped like the ZeRO-2 / ZeRO-3 configs of the HF DeepSpeed docs (all "auto" where they have it).
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **{k: v for k, v in HF_ZERO2.items() if k != "zero_optimization"},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainingArguments starts a process group when the environment names a distributed run; an
    in-process Lightning fit earlier in the same pytest run leaves such variables behind."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _args(tmp_path: pathlib.Path, **overrides):
    transformers = pytest.importorskip("transformers")
    options = {"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
               "learning_rate": 3e-4, "weight_decay": 0.01, "max_grad_norm": 0.5, "warmup_steps": 5,
               "adam_beta2": 0.98, "report_to": [], "use_cpu": True}
    options.update(overrides)
    return transformers.TrainingArguments(**options)


@pytest.mark.parametrize("shipped", [HF_ZERO2, HF_ZERO3], ids=["zero2", "zero3"])
def test_hf_example_configs_resolve_auto_as_the_hf_integration_does(shipped: dict, tmp_path) -> None:
    ds_hf = pytest.importorskip("transformers.integrations.deepspeed")
    args = _args(tmp_path)
    theirs = ds_hf.HfTrainerDeepSpeedConfig(json.loads(json.dumps(shipped)))
    theirs.trainer_config_process(args)
    model = type("M", (), {"config": type("C", (), {"hidden_size": 64})()})()
    theirs.trainer_config_finalize(args, model, num_training_steps=40)
    auto = hf_auto_values(args, world_size=1, hidden_size=64, num_training_steps=40)
    plan = translate(shipped, world_size=1, auto=auto)
    resolved = theirs.config
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.train_batch_size) == (
        resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"],
        resolved["train_batch_size"])
    assert plan.zero.max_grad_norm == resolved["gradient_clipping"]
    assert plan.optimizer.cls is torch.optim.AdamW
    assert plan.optimizer.kwargs == {**resolved["optimizer"]["params"],
                                     "betas": tuple(resolved["optimizer"]["params"]["betas"])}
    assert plan.scheduler["params"] == resolved["scheduler"]["params"]
    assert plan.zero.compute_dtype == torch.float32
    assert plan.zero.stage == shipped["zero_optimization"]["stage"]
    assert plan.zero.reduce_bucket_elements == int(resolved["zero_optimization"]["reduce_bucket_size"])
    assert plan.zero.overlap_comm is True
    if plan.zero.stage == 3:
        assert plan.zero.param_persistence_threshold == resolved["zero_optimization"][
            "stage3_param_persistence_threshold"]
        assert plan.gather_16bit_weights_on_model_save is True
    assert ("steps_per_print", KEYS["steps_per_print"].effect) in plan.accepted


def test_unresolved_auto_and_every_bad_key_are_refused_together_by_path() -> None:
    config = {**HF_ZERO2, "pipeline": {"stages": 2}, "zero_optimization": {
        **HF_ZERO2["zero_optimization"], "mics_shard_size": 4, "stage3_typo": 1}, "prescale_gradients": True}
    with pytest.raises(ValueError) as info:
        translate(config, world_size=2)
    message = str(info.value)
    for expected in ('optimizer.params.lr: "auto" has nothing to resolve it', "train_batch_size: \"auto\"",
                     "pipeline.stages: pipeline parallelism is not in plait",
                     "zero_optimization.mics_shard_size: MiCS is not in plait",
                     "zero_optimization.stage3_typo: not a DeepSpeed key plait knows",
                     "prescale_gradients=True: plait divides the summed gradients once"):
        assert expected in message, (expected, message)


def test_offload_and_onebit_need_their_packages_and_stage_0_needs_ddp(tmp_path) -> None:
    base = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    offload = {**base, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    if importlib.util.find_spec("plait.offload_io") is None:  # installed alone: the piece is named
        with pytest.raises(ValueError, match=r"zero_optimization.offload_optimizer.device: needs plait-offload-io"):
            translate(offload, world_size=1)
    else:  # plait-offload-io registered the keys (tests/test_deepspeed_offload_config.py checks the mapping)
        assert translate(offload, world_size=1).extensions["offload"].device == "cpu"
    onebit = {**base, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}
    if importlib.util.find_spec("plait.onebit_optim") is None:  # installed alone: the piece is named
        with pytest.raises(ValueError, match=r"optimizer.type='OneBitAdam' is not available.*plait-onebit-optim"):
            translate(onebit, world_size=1)
    else:  # plait-onebit-optim registered its types (tests/test_deepspeed_shim_onebit.py runs them)
        assert translate(onebit, world_size=1).optimizer.cls.__name__ == "OnebitAdam"
    with pytest.raises(ValueError, match=r"zero_optimization.stage=0: .*use DDP"):
        translate({**base, "zero_optimization": {"stage": 0}}, world_size=1)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**base, "bf16": {"enabled": True}, "optimizer": {
        "type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "torch_adam": True}}}))
    plan = translate(path, world_size=4)
    assert plan.zero.compute_dtype == torch.bfloat16 and plan.optimizer.cls is torch.optim.Adam
    assert (plan.train_batch_size, plan.gradient_accumulation_steps) == (8, 1)


def test_batch_rule_is_deepspeeds() -> None:
    assert batch_sizes({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2) == (32, 4, 4)
    assert batch_sizes({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4) == (32, 4, 2)
    assert batch_sizes({"train_batch_size": 16}, 4) == (16, 4, 1)
    assert batch_sizes({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2) == (30, 3, 5)
    with pytest.raises(ValueError, match=r"train_batch_size=33 must equal train_micro_batch_size_per_gpu=4 x "):
        batch_sizes({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
                    2)
    with pytest.raises(ValueError, match="sets none of train_batch_size"):
        batch_sizes({}, 1)


def test_readme_key_table_is_generated_from_the_registry() -> None:
    text = README.read_text(encoding="utf-8")
    start, end = "<!-- deepspeed-keys:start -->\n", "<!-- deepspeed-keys:end -->"
    assert start in text and end in text, "README lacks the DeepSpeed key table markers"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == key_table_markdown(), "regenerate with: python -c 'from plait.zero_sharding.deepspeed.keys " \
        "import key_table_markdown; print(key_table_markdown())'"


def test_base64_config_is_read_as_hfs_deepspeed_argument_is(tmp_path) -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    assert load_config(encoded) == config
    assert load_config(encoded.rstrip("=")) == config  # padding dropped, as shells and env vars do
    assert translate(encoded, world_size=2).zero.stage == 2
    with pytest.raises(FileNotFoundError):
        load_config(str(tmp_path / "missing.json"))
