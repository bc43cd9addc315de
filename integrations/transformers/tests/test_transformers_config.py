"""Config files, ``TrainingArguments`` translation and contradictions: errors that name the field,
raised when the Trainer is built (before any training work)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.transformers import PlaitConfig, load_config, with_plait, zero_config_for
from plait.transformers.demo import TokenDataset, deepspeed_config, tiny_llama_model, training_args
from plait.zero_sharding import ZeroConfig


def _trainer(tmp_path: Path, config: Any = None, **args: Any) -> Any:
    import transformers

    cls = with_plait(transformers.Trainer, config)
    return cls(model=tiny_llama_model(), args=training_args(str(tmp_path), **args), train_dataset=TokenDataset(8))


def test_file_route_reads_every_field(tmp_path: Path) -> None:
    path = tmp_path / "plait.json"
    path.write_text(json.dumps({"zero": {"stage": 2, "reduce_bucket_elements": 1000}, "verify_on_load": False}))
    config = load_config(path)
    assert config.zero == ZeroConfig(stage=2, reduce_bucket_elements=1000)
    assert config.verify_on_load is False
    assert load_config('{"zero": {"stage": 1}}').zero.stage == 1  # inline JSON


def test_zeropp_is_a_field_of_the_zero_section() -> None:
    from plait.zero_sharding.zeropp import ZeroPPConfig

    config = load_config('{"zero": {"stage": 3, "zeropp": {"gradient_bits": 8, "hierarchical_partition_size": 8}}}')
    assert config.zero.zeropp == ZeroPPConfig(gradient_bits=8, hierarchical_partition_size=8)
    assert load_config('{"zero": {"zeropp": true}}').zero.zeropp == ZeroPPConfig()
    with pytest.raises(ValueError, match="ZeroConfig.zeropp.*stage=2"):
        load_config('{"zero": {"stage": 2, "zeropp": true}}')


@pytest.mark.parametrize(("content", "named"), [
    ({"zero": {"stage": 3}, "stag": 2}, "'stag'"),
    ({"zero": {"stage": 3, "offlod": "cpu"}}, "zero.offlod"),
    ({"zero": {"stage": 4}}, "ZeroConfig.stage=4"),
    ({"zero": {"stage": 1}, "offload": "cpu"}, "PlaitConfig.offload"),
    ({"offload": "disk"}, "PlaitConfig.offload='disk'"),
    ({"verify_on_load": "yes"}, "PlaitConfig.verify_on_load"),
    ({"zero": 3}, "'zero' must be an object"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_config_files_name_the_field(tmp_path: Path, content: Any, named: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("{zero: 3")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path / "broken.json")


def test_precision_and_clipping_translate_from_training_args(tmp_path: Path) -> None:
    config = PlaitConfig(zero=ZeroConfig(stage=3))
    bf16 = zero_config_for(config, training_args(str(tmp_path), bf16=True))
    assert (bf16.compute_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp32 = zero_config_for(config, training_args(str(tmp_path)))
    assert (fp32.compute_dtype, fp32.reduce_dtype) == (torch.float32, torch.float32)


@pytest.mark.parametrize(("config", "args", "named"), [
    (ZeroConfig(stage=3), {"deepspeed": deepspeed_config(3)}, "TrainingArguments.deepspeed"),
    (ZeroConfig(stage=3), {"fsdp": True}, "TrainingArguments.fsdp"),
    (ZeroConfig(stage=3, compute_dtype="fp16"), {"bf16": True}, "ZeroConfig.compute_dtype"),
    (ZeroConfig(stage=3, max_grad_norm=0.5), {"max_grad_norm": 1.0}, "TrainingArguments.max_grad_norm=1.0"),
    (ZeroConfig(stage=3, loss_scale=128.0), {}, "ZeroConfig.loss_scale"),
    (ZeroConfig(stage=3), {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
     "TrainingArguments.load_best_model_at_end"),
    (ZeroConfig(stage=3), {"push_to_hub": True, "hub_model_id": "plait-test/never-pushed"},
     "TrainingArguments.push_to_hub"),
])
def test_contradictions_fail_when_the_trainer_is_built(tmp_path: Path, config: ZeroConfig, args: dict,
                                                      named: str) -> None:
    if "deepspeed" in args:
        pytest.importorskip("deepspeed", reason="TrainingArguments(deepspeed=...) imports DeepSpeed")
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        _trainer(tmp_path, config, **args)


def test_with_plait_refuses_a_non_trainer_and_caches_classes() -> None:
    import transformers

    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        with_plait(torch.nn.Module)
    config = PlaitConfig(zero=ZeroConfig(stage=2))
    assert with_plait(transformers.Trainer, config) is with_plait(transformers.Trainer, config)
    assert with_plait(transformers.Trainer, config).__name__ == "PlaitTrainer"
    assert issubclass(with_plait(transformers.Seq2SeqTrainer), transformers.Seq2SeqTrainer)


def test_config_from_args_or_environment_and_never_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from plait.transformers import PlaitTrainingArguments

    parser = transformers.HfArgumentParser(PlaitTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "true",
                                                  "--report_to", "none", "--plait_config", '{"zero": {"stage": 1}}'])
    cls = with_plait(transformers.Trainer)
    trainer = cls(model=tiny_llama_model(), args=args, train_dataset=TokenDataset(8))
    assert trainer.plait_config.zero.stage == 1
    monkeypatch.setenv("PLAIT_CONFIG", '{"zero": {"stage": 2}}')
    with pytest.raises(ValueError, match=r"TrainingArguments\.plait_config and \$PLAIT_CONFIG"):
        cls(model=tiny_llama_model(), args=args, train_dataset=TokenDataset(8))
    assert _trainer(tmp_path).plait_config.zero.stage == 2


def test_offload_without_stage_2_is_refused() -> None:
    with pytest.raises(ValueError, match="PlaitConfig.offload"):
        PlaitConfig(zero=ZeroConfig(stage=1), offload="cpu")


def test_sharded_from_pretrained_needs_a_local_safetensors_directory(tmp_path: Path) -> None:
    from plait.transformers.loading import sharded_from_pretrained

    with pytest.raises(ValueError, match="sharded_from_pretrained"):
        sharded_from_pretrained(tmp_path)
    tiny_llama_model().save_pretrained(tmp_path / "m")
    model = sharded_from_pretrained(tmp_path / "m")
    assert all(p.is_meta for p in model.parameters())
    assert type(model).__name__ == "LlamaForCausalLM"


class _Extension:
    """A ShardingExtension recording its ``check`` calls; ``refuse`` makes ``check`` raise,
    ``supplies`` is what ``zero_kwargs`` returns."""

    order = 40

    def __init__(self, *, refuse: bool = False, supplies: dict[str, Any] | None = None) -> None:
        self.refuse, self.supplies, self.checked = refuse, supplies or {}, []

    def check(self, settings: Any, precision: str) -> None:
        self.checked.append((settings, precision))
        if self.refuse:
            raise ValueError("_Extension refuses this plan")

    def apply(self, module: Any, mesh: Any) -> Any:
        return module

    def zero_kwargs(self) -> dict[str, Any]:
        return dict(self.supplies)


def test_extensions_are_validated_and_kept_as_a_tuple() -> None:
    ext = _Extension()
    assert PlaitConfig(extensions=[ext]).extensions == (ext,)
    assert PlaitConfig().extensions == ()
    with pytest.raises(ValueError, match=r"PlaitConfig\.extensions\[1\].*ShardingExtension"):
        PlaitConfig(extensions=(ext, object()))
    with pytest.raises(ValueError, match=r"PlaitConfig\.extensions=.*tuple"):
        PlaitConfig(extensions=ext)
    bad = _Extension()
    bad.order = "first"
    with pytest.raises(ValueError, match=r"PlaitConfig\.extensions\[0\].*order must be an int"):
        PlaitConfig(extensions=(bad,))


def test_a_config_file_cannot_give_extensions(tmp_path: Path) -> None:
    path = tmp_path / "ext.json"
    path.write_text(json.dumps({"zero": {"stage": 2}, "extensions": ["my.Extension"]}))
    with pytest.raises(ValueError, match=r"\['extensions'\] cannot be given in a config file.*in code") as info:
        load_config(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match=r"the known keys are \['ep_size', 'offload', 'offload_path', 'optimizer', "
                                         r"'sp_size', 'tp_size', 'verify_on_load', 'zero'\]"):
        load_config({"zeros": {}})


def test_extensions_are_checked_when_the_trainer_is_built(tmp_path: Path) -> None:
    ext = _Extension()
    config = PlaitConfig(zero=ZeroConfig(stage=2), extensions=(ext,))
    trainer = _trainer(tmp_path, config, bf16=True)
    assert [p for _, p in ext.checked] == ["bf16-mixed"]
    assert ext.checked[0][0] is trainer.plait_config
    with pytest.raises(ValueError, match="_Extension refuses"):
        _trainer(tmp_path, PlaitConfig(zero=ZeroConfig(stage=2), extensions=(_Extension(refuse=True),)))


def test_an_extension_supplying_an_unknown_keyword_is_refused(tmp_path: Path) -> None:
    # (an extension's placement against offload="cpu" is tested with plait-offload-io, in the
    # repository's tests/test_transformers_offload.py)
    with pytest.raises(ValueError, match=r"only \('reducer', 'gatherer', 'placement', 'param_groups'\)"):
        _trainer(tmp_path, PlaitConfig(zero=ZeroConfig(stage=2), extensions=(_Extension(supplies={"mesh": 1}),)))


def test_parallel_and_onebit_keys_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plait.json"
    path.write_text(json.dumps({"zero": {"stage": 3}, "sp_size": 2, "ep_size": 1}))
    config = load_config(path)
    assert (config.sp_size, config.ep_size, config.onebit) == (2, 1, None)
    with pytest.raises(ValueError, match=r"PlaitConfig\.ep_size=True must be a positive int"):
        load_config({"ep_size": True})
    with pytest.raises(ValueError, match=r"\['onebit'\]; the known keys are .*'optimizer'"):
        load_config({"onebit": {"freeze_step": 3}})
    with pytest.raises(ValueError, match=r"PlaitConfig\.onebit=.*OnebitAdamConfig"):
        PlaitConfig(onebit={"freeze_step": 3})


@pytest.mark.parametrize(("field", "package", "extra"), [("sp_size", "plait-ulysses-sp", "sp"),
                                                         ("ep_size", "plait-moe-layers", "moe")])
def test_a_missing_parallel_package_is_named_with_its_pip_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               field: str, package: str, extra: str) -> None:
    import importlib.util

    real = importlib.util.find_spec
    hidden = package.replace("-", ".", 1).replace("-", "_")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))
    with pytest.raises(ImportError, match=rf"PlaitConfig\.{field}=2 needs {package}.*pip install {package} .*"
                                          rf"plait-transformers\[{extra}\]"):
        _trainer(tmp_path, PlaitConfig(**{field: 2}))


def test_parallel_sizes_must_divide_the_world() -> None:
    from plait.transformers.parallel import check_world_size

    check_world_size(2, 2, 8)
    with pytest.raises(ValueError, match=r"PlaitConfig\.sp_size=2 x ep_size=2 = 4 does not divide the world size 6"):
        check_world_size(2, 2, 6)
    with pytest.raises(ValueError, match=r"PlaitConfig\.ep_size=3 does not divide the world size 4.*\[1, 2, 4\]"):
        check_world_size(1, 3, 4)
