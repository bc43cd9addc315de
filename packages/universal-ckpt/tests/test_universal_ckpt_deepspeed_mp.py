"""Import model-parallel DeepSpeed checkpoints written here on CPU by deepspeed itself.

Megatron-DeepSpeed 3-D: a pp=2 x tp=2 PipelineModule of Megatron-style parallel MLP blocks
(``ds_3d_models``), which DeepSpeed saves as ``layer_LL-model_TT-model_states.pt``; the client's
``universal_checkpoint_info`` patterns are the only layout information, as in Megatron-DeepSpeed.

AutoTP: a tiny HF Llama trained with ``tensor_parallel.autotp_size=2`` + ZeRO-1 at W=2 (TP=2) and
W=4 (TP=2 x DP=2). PipelineModule: eight plain layers (a ReLU among them) at 2 and 4 stages. DeepSpeed's own
``ds_to_universal`` is the oracle for every tensor (moments and step included); for pipelines it
needs the client's ``universal_checkpoint_info``, so those runs save a second tag with an empty one
for it, while plait converts the tag saved without.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.interop.deepspeed import import_deepspeed
from plait.universal_ckpt.interop.hf import export_hf

sys.path.insert(0, str(Path(__file__).parent))
import ds_3d_models

VOCAB = 64
STEPS = 2
# name -> (world size, ZeRO stage, bf16, vocabulary, tied embeddings): TP=2 at W=2; TP=2 x DP=2 at W=4 (fp32
# ZeRO-1, bf16 ZeRO-2); an odd vocabulary, which AutoTP splits unevenly (33 + 32 rows of the LM head, no
# padding); tied input/output embeddings (AutoTP then splits the shared embedding over the vocabulary).
AUTOTP_RUNS = {"w2": (2, 1, False, VOCAB, False), "w4": (4, 1, False, VOCAB, False),
               "w4_zero2_bf16": (4, 2, True, VOCAB, False), "w2_vocab65": (2, 1, False, VOCAB + 1, False),
               "w2_tied": (2, 1, False, VOCAB, True)}


def _init_deepspeed():
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator JIT-compiles a shared-memory all-reduce on init; gloo needs none of it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    return deepspeed


def _llama_config(vocab: int = VOCAB, tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=tied, attn_implementation="eager")


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))


ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
RESUMED_STEPS = 20
# name -> (world size, pipeline stages): 2 and 4 stages, and 2 stages x DP=2 (ZeRO-1 partitions per stage).
PIPELINE_RUNS = {"pp2": (2, 2), "pp4": (4, 4), "pp2_dp2": (4, 2)}
# Resumed losses vs DeepSpeed continuing: the first differs by ~1e-7 relative (float32 rounding of the
# row-parallel sums), and 20 AdamW steps keep the drift within 1e-5 (the torch TP test's tolerance).
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _batches(seed: int, count: int, vocab: int = VOCAB) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 8), generator=generator) for _ in range(count)]


def make_autotp(root: str, stage: int, bf16: bool, vocab: int, tied: bool, more: int) -> dict:
    """Train 2 steps under AutoTP=2 + ZeRO-``stage``, save, then ``more`` steps (DeepSpeed continuing).

    Returns the trained parallel model's logits at the save and the continuation's losses.
    """
    deepspeed = _init_deepspeed()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(vocab, tied))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
              "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 10**6, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for ids in _batches(1, STEPS, vocab):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(root, tag="step2")
    engine.module.eval()
    with torch.no_grad():
        logits = engine.module(input_ids=_tokens()).logits.detach().clone()
    engine.module.train()
    losses = []
    for ids in _batches(2, more):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"logits": logits, "losses": losses}


def _layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 8) for _ in range(6)] + [torch.nn.ReLU(), torch.nn.Linear(8, 3)]


def make_pipeline(root: str, stages: int) -> dict[str, torch.Tensor]:
    """Train a PipelineModule 2 steps with ZeRO-1; returns this stage's weights under global names."""
    deepspeed = _init_deepspeed()
    from deepspeed.pipe import PipelineModule

    model = PipelineModule(layers=_layers(), num_stages=stages, loss_fn=torch.nn.functional.mse_loss,
                           partition_method="type:Linear")  # every stage holds parameters
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(1)
    batches = iter([(torch.randn(2, 8, generator=generator), torch.randn(2, 3, generator=generator))
                    for _ in range(2 * STEPS)])
    for _ in range(STEPS):
        engine.train_batch(batches)
    engine.save_checkpoint(f"{root}/plain", tag="step2")
    engine.save_checkpoint(f"{root}/with_info", tag="step2", client_state={"universal_checkpoint_info": {}})
    return {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}


class _AutotpRuns:
    """DeepSpeed AutoTP runs, each trained the first time a test asks for it: ``runs(name) -> (dir, result)``."""

    def __init__(self, root: Path) -> None:
        self.root, self.results = root, {}

    def __call__(self, name: str) -> tuple[Path, dict]:
        if name not in self.results:
            world, stage, bf16, vocab, tied = AUTOTP_RUNS[name]
            more = RESUMED_STEPS if name == "w2" else 0  # DeepSpeed continuing in its own layout
            per_rank = run_distributed(make_autotp, world, str(self.root / name), stage, bf16, vocab, tied, more,
                                       timeout=120, env={"DS_ACCELERATOR": "cpu"})
            result = per_rank[0]
            if result["logits"].shape[-1] != vocab:  # a vocabulary-parallel head's output is not gathered
                result["logits"] = torch.cat([r["logits"] for r in per_rank[:2]], -1)
            self.results[name] = result
        return self.root / name, self.results[name]


@pytest.fixture(scope="module")
def autotp(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    return _AutotpRuns(tmp_path_factory.mktemp("autotp"))


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("pipe")
    weights = {}
    for name, (world, stages) in PIPELINE_RUNS.items():
        per_rank = run_distributed(make_pipeline, world, str(root / name), stages, timeout=120,
                                   env={"DS_ACCELERATOR": "cpu"})
        weights[name] = {param: tensor for rank in per_rank for param, tensor in rank.items()}
    return root, weights


def make_3d(*args):
    os.environ["DS_ACCELERATOR"] = "cpu"
    return ds_3d_models.make_3d(*args)


@pytest.fixture(scope="module")
def three_d(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("three_d")
    per_rank = run_distributed(make_3d, 4, str(root / "ds"), 2, 2, 4, timeout=120,
                               env={"DS_ACCELERATOR": "cpu"})
    stages = [[weights for stage, weights in per_rank if stage == s] for s in (0, 1)]
    return root / "ds", {n: t for shards in stages for n, t in ds_3d_models.assemble(shards).items()}


def _ds_to_universal(tag_dir: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(tag_dir), "--output_folder", str(out), "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / "zero"


def _assert_equals_ds_to_universal(ckpt: Path, reference: Path) -> int:
    """Every tensor ds_to_universal writes (fp32, exp_avg, exp_avg_sq, step) is bitwise ours."""
    manifest = uc.verify_checkpoint(ckpt)
    compared = 0
    for param in sorted(p.name for p in reference.iterdir() if p.is_dir()):
        for field, ours in (("fp32", f"model.{param}"), ("exp_avg", f"optim.exp_avg.{param}"),
                            ("exp_avg_sq", f"optim.exp_avg_sq.{param}"), ("step", f"optim.step.{param}")):
            theirs = torch.load(reference / param / f"{field}.pt", weights_only=False)
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs
            mine = uc.read_full(ckpt, manifest, manifest.tensors[f"model/{ours}"])
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (param, field)
            assert torch.equal(mine, theirs), (param, field)
            compared += 1
    return compared


@pytest.mark.parametrize("run", list(AUTOTP_RUNS))
def test_autotp_matches_ds_to_universal(autotp, tmp_path, run):
    src, _ = autotp(run)
    world, stage, _, _, tied = AUTOTP_RUNS[run]
    ckpt = import_deepspeed(src, tmp_path / "uc")
    manifest = uc.read_manifest(ckpt)
    assert manifest.layout.mesh == {"tp": 2, "pp": 1, "dp": world // 2} and manifest.layout.zero_stage == stage
    patterns = {e.name: e.pattern for e in manifest.tensors.values()}
    assert patterns["model.model.layers.0.self_attn.o_proj.weight"] == {"dim": 1, "group": "tp"}  # row-parallel
    assert patterns["model.model.layers.0.mlp.gate_proj.weight"] == {"dim": 0, "group": "tp"}
    assert patterns["model.model.norm.weight"] == {"dim": None, "group": "tp"}
    reference = _ds_to_universal(src / "step2", tmp_path / "ds_universal")
    if tied:  # the alias DeepSpeed also writes is rank 0's local shard, not the tensor: we store it once
        alias = torch.load(reference / "lm_head.weight" / "fp32.pt", weights_only=False)["param"]
        assert alias.shape == (VOCAB // 2, 32) and "model/model.lm_head.weight" not in manifest.tensors
        shutil.rmtree(reference / "lm_head.weight")
    assert _assert_equals_ds_to_universal(ckpt, reference) == 4 * (20 if tied else 21)  # Llama parameters


@pytest.mark.parametrize("run", ["w2", "w2_vocab65", "w2_tied"])
def test_autotp_hf_export_gives_trained_logits(autotp, tmp_path, run):
    from transformers import LlamaForCausalLM

    src, result = autotp(run)
    ckpt = import_deepspeed(src, tmp_path / "uc")
    export_hf(ckpt, tmp_path / "hf", config=_llama_config(*AUTOTP_RUNS[run][3:]))
    model, info = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        ours = model.eval()(input_ids=_tokens()).logits
    # TP=2 sums the row-parallel halves in another order than one matmul does: float32 rounding.
    assert ours.shape[-1] == AUTOTP_RUNS[run][3]
    torch.testing.assert_close(ours, result["logits"], rtol=1e-5, atol=1e-5)
    if run == "w2":  # the same run under DP=2
        torch.testing.assert_close(autotp("w4")[1]["logits"], result["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", list(PIPELINE_RUNS))
def test_pipeline_module_to_single_process(pipelines, tmp_path, run):
    root, weights = pipelines
    world, stages = PIPELINE_RUNS[run]
    ckpt = import_deepspeed(root / run / "plain", tmp_path / "uc")
    manifest = uc.read_manifest(ckpt)
    assert manifest.layout.mesh == {"tp": 1, "pp": stages, "dp": world // stages}
    single = torch.nn.Sequential(*_layers())
    state = {name: uc.read_full(ckpt, manifest, manifest.tensors[f"model/model.{name}"])
             for name in single.state_dict()}
    single.load_state_dict(state, strict=True)
    for name, tensor in weights[run].items():  # what each stage held after training
        assert torch.equal(single.state_dict()[name], tensor), name
    reference = torch.nn.Sequential(*_layers())
    reference.load_state_dict(weights[run])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(single(x), reference(x))
    oracle = _ds_to_universal(root / run / "with_info" / "step2", tmp_path / "ds_universal")
    assert _assert_equals_ds_to_universal(ckpt, oracle) == 4 * 14  # 7 Linear layers


def _pipeline_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(2)]


def _perturbed_layers() -> list[torch.nn.Module]:
    """``_layers()`` moved away from their seed: every loaded value must come from the checkpoint."""
    layers = _layers()
    with torch.no_grad():
        for param in torch.nn.Sequential(*layers).parameters():
            param.add_(1.0)
    return layers


def _with_optimizer(module: torch.nn.Module, name_map=None) -> tuple[torch.optim.Optimizer, uc.ModelParallelState]:
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return optimizer, uc.model_parallel(module, optimizer, config=uc.ModelParallelConfig(name_map=name_map))


def load_two_pipelining_stages(ckpt: str) -> dict:
    """The converted PipelineModule checkpoint into 2 ``torch.distributed.pipelining`` stages (a manual
    split of the same 8 layers, 4 per stage, renumbered from 0): the loaded state, then 2 GPipe steps."""
    import pipelining_models as pm
    from torch.distributed.pipelining import PipelineStage

    rank = torch.distributed.get_rank()
    first = 4 * rank
    submodule = torch.nn.Sequential(*_perturbed_layers()[first:first + 4])
    name_map = uc.layer_offset("", first)
    optimizer, state = _with_optimizer(submodule, name_map)
    uc.load({"model": state}, ckpt)
    loaded = pm.states(submodule, optimizer, name_map)
    stage = PipelineStage(submodule, rank, 2, torch.device("cpu"))
    return {"states": loaded, "losses": pm.pipeline_train(stage, optimizer, _pipeline_batches(),
                                                          loss=torch.nn.functional.mse_loss)}


@pytest.mark.parametrize("run", ["pp2", "pp4"])
def test_pipeline_module_to_two_pipelining_stages(pipelines, tmp_path, run):
    """DeepSpeed PipelineModule (2 or 4 stages) -> universal -> 2 torch.distributed.pipelining stages:
    every weight and AdamW tensor bitwise the one-process load's, the next 2 GPipe steps' micro-batch
    losses bitwise the one process's (same micro-batches, gradients divided as GPipe does)."""
    pytest.importorskip("torch.distributed.pipelining")
    import pipelining_models as pm

    root, _ = pipelines
    ckpt = import_deepspeed(root / run / "plain", tmp_path / "uc")
    manifest = uc.read_manifest(ckpt)
    stages = PIPELINE_RUNS[run][1]
    assert manifest.tensors["model/model.0.weight"].pattern == {"stages": [0]}  # pipeline placement
    assert manifest.tensors["model/optim.exp_avg.7.weight"].pattern == {"stages": [stages - 1]}
    single = torch.nn.Sequential(*_perturbed_layers())
    optimizer, state = _with_optimizer(single)
    uc.load({"model": state}, ckpt)
    expected = pm.states(single, optimizer)
    ranks = run_distributed(load_two_pipelining_stages, 2, str(ckpt), timeout=120)
    loaded = {name: tensor for rank in ranks for name, tensor in rank["states"].items()}
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    losses = pm.single_train(single, optimizer, _pipeline_batches(), loss=torch.nn.functional.mse_loss)
    assert ranks[-1]["losses"] == losses


@pytest.mark.parametrize("missing", ["zero_pp_rank_1_mp_rank_01_optim_states.pt", "mp_rank_01_model_states.pt"])
def test_missing_mp_rank_file_is_named_before_writing(autotp, tmp_path, missing):
    broken = tmp_path / "broken"
    shutil.copytree(autotp("w4")[0], broken)
    (broken / "step2" / missing).unlink()
    with pytest.raises(uc.CheckpointFormatError) as info:
        import_deepspeed(broken, tmp_path / "uc")
    message = str(info.value)
    assert missing in message and "self_attn.q_proj.weight" in message and "copy it" in message, message
    assert not (tmp_path / "uc").exists() or not any((tmp_path / "uc").iterdir())


def test_cli_detects_model_parallel_source_and_inspect_shows_sizes(three_d, pipelines, tmp_path, capsys):
    from plait.universal_ckpt.cli import register

    def plait(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="plait")
        register(parser.add_subparsers(dest="command"))
        args = parser.parse_args(list(argv))
        return args.func(args)

    assert plait("ckpt", "convert", str(three_d[0]), str(tmp_path / "tp"), "--to", "universal") == 0
    assert plait("ckpt", "convert", str(pipelines[0] / "pp2" / "plain"), str(tmp_path / "pp"), "--to", "hf") == 0
    capsys.readouterr()
    assert plait("ckpt", "inspect", str(tmp_path / "tp")) == 0
    out = capsys.readouterr().out
    assert "tp=2 pp=2 dp=1" in out and "tp:dim1" in out and "tp:replicated" in out, out


def test_megatron_deepspeed_3d_to_single_process(three_d, tmp_path):
    src, trained = three_d
    assert (src / "step2" / "layer_03-model_01-model_states.pt").exists()  # the 3-D file layout
    ckpt = import_deepspeed(src, tmp_path / "uc")
    manifest = uc.read_manifest(ckpt)
    assert manifest.layout.mesh == {"tp": 2, "pp": 2, "dp": 1}
    single = ds_3d_models.full_model(4)
    single.load_state_dict({name: uc.read_full(ckpt, manifest, manifest.tensors[f"model/model.{name}"])
                            for name in single.state_dict()}, strict=True)
    for name, tensor in trained.items():  # the shards each rank trained, concatenated by hand
        assert torch.equal(single.state_dict()[name], tensor), name
    reference = ds_3d_models.full_model(4)
    reference.load_state_dict(trained)
    x = torch.randn(4, ds_3d_models.HIDDEN, generator=torch.Generator().manual_seed(3))
    assert torch.equal(single(x), reference(x))
    oracle = _ds_to_universal(src / "step2", tmp_path / "ds_universal")
    assert _assert_equals_ds_to_universal(ckpt, oracle) == 4 * 24  # 4 blocks x 6 tensors


def _resume(root: str, tp: int) -> list[float]:
    """Load the converted AutoTP checkpoint into HF Llama + torch AdamW (torch TP when ``tp`` > 1), train on."""
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    import mp_models

    torch.manual_seed(5)  # other initial weights: everything must come from the checkpoint
    model = LlamaForCausalLM(_llama_config())
    config = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        model = mp_models.torch_tp(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
        config = uc.ModelParallelConfig(groups={"tp": tuple(range(tp))})
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    uc.load({"model": uc.model_parallel(model, optimizer, config=config)}, root)
    model.train()
    losses = []
    for ids in _batches(2, RESUMED_STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def resume_torch_tp(root: str) -> list[float]:
    return _resume(root, 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_autotp_resumes_in_one_process_and_torch_tp(autotp, tmp_path, tp):
    """DeepSpeed AutoTP=2 -> universal -> HF Llama with torch AdamW, alone or under torch TP=2: the next
    20 losses follow DeepSpeed continuing in its own layout."""
    pytest.importorskip("torch.distributed.tensor.parallel")
    src, result = autotp("w2")
    import_deepspeed(src, tmp_path / "uc")
    if tp == 1:
        losses = _resume(str(tmp_path / "uc"), 1)
    else:
        losses = run_distributed(resume_torch_tp, 2, str(tmp_path / "uc"), timeout=120)[0]
    # The state carried over is bitwise DeepSpeed's (test above); what differs is float32 rounding: the
    # row-parallel partial sums are added in another order (one matmul vs TP's all-reduce), and AdamW
    # carries that difference forward step by step. LOSS_TOLERANCE is that drift over 20 steps. DeepSpeed's
    # default gradient clipping (1.0) is switched off in the fixture: torch's loop does not clip.
    torch.testing.assert_close(losses, result["losses"], **LOSS_TOLERANCE)


def test_import_runs_without_deepspeed(autotp, tmp_path):
    """The converter reads DeepSpeed's pickles with stand-ins: a process where deepspeed cannot import."""
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from plait.universal_ckpt.interop.deepspeed import import_deepspeed\n"
            f"print(import_deepspeed({str(autotp('w4')[0])!r}, {str(tmp_path / 'uc')!r}))\n"
            "assert 'deepspeed' not in {m.split('.')[0] for m, v in sys.modules.items() if v is not None}")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert uc.verify_checkpoint(uc.latest(tmp_path / "uc")).layout.mesh == {"tp": 2, "pp": 1, "dp": 2}
