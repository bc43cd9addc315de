"""Benchmark rows for model-parallel DeepSpeed sources: AutoTP and ``PipelineModule`` -> universal.

Each source is written by deepspeed itself on 2 gloo ranks (one AdamW step, ZeRO-1, fp32), then
converted by DeepSpeed's ``ds_to_universal`` (one extract and one merge worker, in process) and by
``import_deepspeed``, interleaved (A B A B), median. Full size: an HF Llama of 106M parameters
(hidden 768, 8 layers, vocabulary 32000) under AutoTP=2, and a PipelineModule of 24
``Linear(2048, 2048)`` (101M) in 2 stages; ``--quick`` shrinks both. The pipeline checkpoint is
saved with an empty ``universal_checkpoint_info`` client state, which ``ds_to_universal`` needs and
the importer does not.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from plait.kernels.bench import BenchRow, TimingStats, interleaved_timing, timing_row

TARGET_RATIO = 0.5  # the target: plait's conversion at most half ds_to_universal's time


def _deepspeed():
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of a shm all-reduce
    deepspeed.init_distributed("gloo")
    return deepspeed


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, **extra}


def _llama(quick: bool):
    """The benchmark's HF Llama: 106M parameters (hidden 768, 8 layers, vocabulary 32000), tiny with quick."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512) if quick else dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=8, vocab_size=32000)
    return LlamaForCausalLM(LlamaConfig(num_attention_heads=4 if quick else 12, num_key_value_heads=4 if quick else 12,
                                        max_position_embeddings=64, tie_word_embeddings=False, **size))


def make_autotp_checkpoint(root: str, quick: bool) -> int:
    """An AutoTP=2 + ZeRO-1 checkpoint of an HF Llama; returns its parameter count."""
    deepspeed = _deepspeed()
    model = _llama(quick)
    size = {"vocab_size": model.config.vocab_size}
    count = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(tensor_parallel={"autotp_size": 2}))
    ids = torch.randint(0, size["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(root, tag="step1")
    return count


def make_pipeline_checkpoint(root: str, quick: bool) -> int:
    """A 2-stage PipelineModule + ZeRO-1 checkpoint of Linear layers; returns its parameter count."""
    deepspeed = _deepspeed()
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    width, depth = (256, 4) if quick else (2048, 24)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    count = sum(p.numel() for layer in layers for p in layer.parameters())
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                           partition_method="parameters")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
    engine.train_batch(iter([(torch.randn(1, width), torch.randn(1, width))]))
    engine.save_checkpoint(root, tag="step1", client_state={"universal_checkpoint_info": {}})
    return count


def _ds_to_universal(tag_dir: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder", str(tag_dir), "--output_folder", str(out),
                                "--num_extract_workers", "1", "--num_merge_workers", "1"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv


def _rounds(candidates: dict[str, Callable[[Path], object]], out: Path, *, warmup: int,
            steps: int) -> dict[str, TimingStats]:
    """Interleaved timing (A B A B, ``interleaved_timing``) of candidates writing under ``out``, with
    ``out`` emptied between rounds, untimed: the full-size outputs are 1.3 GB each, too many to keep."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    counter = itertools.count()
    for index in range(warmup + steps):
        calls = {name: (lambda fn=fn: fn(out / str(next(counter)))) for name, fn in candidates.items()}
        stats = interleaved_timing(calls, warmup=0, steps=1)
        shutil.rmtree(out, ignore_errors=True)
        if index >= warmup:
            for name, stat in stats.items():
                samples[name] += stat.samples
    return {name: TimingStats.of(values) for name, values in samples.items()}


def model_parallel_rows(tmp: Path, quick: bool) -> list[BenchRow]:
    """The AutoTP and PipelineModule conversion rows (a note row when deepspeed is missing)."""
    try:
        import deepspeed  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return [BenchRow(benchmark="DeepSpeed AutoTP / PipelineModule -> universal", figure="time (s)",
                         ours=float("nan"), peer="ds_to_universal", note=f"not installed: {exc}")]
    from plait.kernels.testing import run_distributed
    from plait.universal_ckpt.interop.deepspeed import import_deepspeed

    rows, counts = [], {}
    sources = (("AutoTP=2 HF Llama", make_autotp_checkpoint), ("PipelineModule 2 stages", make_pipeline_checkpoint))
    for label, make in sources:
        src = tmp / label.split()[0]
        count = counts[src.name] = run_distributed(make, 2, str(src), quick, timeout=600,
                                                   env={"DS_ACCELERATOR": "cpu"})[0]

        def ours(out: Path, src=src) -> None:
            import_deepspeed(src, out)

        def theirs(out: Path, src=src) -> None:
            _ds_to_universal(src / "step1", out)

        stats = _rounds({"ours": ours, "ds": theirs}, tmp / "converted", warmup=1 if quick else 0, steps=3)
        if make is make_pipeline_checkpoint:
            shutil.rmtree(src, ignore_errors=True)
        row = timing_row(f"DeepSpeed {label} ZeRO-1 W=2, {count / 1e6:.3g}M params -> universal", stats["ours"],
                         "ds_to_universal", stats["ds"], target_ratio=TARGET_RATIO)
        rows.append(BenchRow(**{**row.__dict__, "note": row.note + f"; {len(stats['ours'].samples)} timed runs"}))
    return rows + online_load_rows(tmp, quick, autotp=(tmp / "AutoTP=2", counts["AutoTP=2"]))


def _torch_tp(model, mesh):
    """torch TP on the Llama: column-parallel q/k/v/gate/up, row-parallel o/down."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for index in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{index}.{name}"] = ColwiseParallel()
        plan[f"model.layers.{index}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{index}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def resave_under_torch_tp(converted: str, dst: str, quick: bool) -> None:
    """Load the converted AutoTP run into torch TP=2 (W=2) and save it there: plait's own TP=2 checkpoint."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import plait.universal_ckpt as uc

    model = _torch_tp(_llama(quick), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = uc.ModelParallelConfig(groups={"tp": tuple(range(dist.get_world_size()))})
    state = {"model": uc.model_parallel(model, optimizer, config=config)}
    uc.load(state, converted)
    uc.save(state, dst, step=1)


def online_load_rows(tmp: Path, quick: bool, autotp: tuple[Path, int] | None = None) -> list[BenchRow]:
    """Loading a TP=2 checkpoint into one process (weights, moments, step): plait's online reshard of its
    own TP=2 checkpoint vs converting DeepSpeed's AutoTP=2 checkpoint of the same run first
    (``import_deepspeed``, then the load). Both end with the same state in the same model.

    Args:
        tmp: scratch directory.
        quick: the tiny model.
        autotp: an AutoTP=2 checkpoint directory already written by :func:`make_autotp_checkpoint`
            and its parameter count (the full suite reuses the conversion rows' one); None writes one.
    """
    from plait.kernels.testing import run_distributed
    from plait.universal_ckpt import api
    from plait.universal_ckpt.interop.deepspeed import import_deepspeed
    from plait.universal_ckpt.parallel_layout import model_parallel

    if autotp is None:
        src = tmp / "online-autotp"
        count = run_distributed(make_autotp_checkpoint, 2, str(src), quick, timeout=600,
                                env={"DS_ACCELERATOR": "cpu"})[0]
    else:
        src, count = autotp
    converted = import_deepspeed(src, tmp / "online-converted")
    run_distributed(resave_under_torch_tp, 2, str(converted), str(tmp / "online-tp2"), quick, timeout=600)
    shutil.rmtree(converted.parent)
    model = _llama(quick)
    state = {"model": model_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3))}

    def online(out: Path) -> None:
        api.load(state, tmp / "online-tp2")

    def convert_then_load(out: Path) -> None:
        api.load(state, import_deepspeed(src, out))

    stats = _rounds({"online": online, "convert": convert_then_load}, tmp / "online-convert", warmup=1, steps=3)
    row = timing_row(f"TP=2 HF Llama {count / 1e6:.3g}M params -> one process: online load of plait's TP=2 checkpoint",
                     stats["online"], "import_deepspeed + load", stats["convert"])
    return [BenchRow(**{**row.__dict__, "note": row.note + f"; {len(stats['online'].samples)} timed runs"})]


if __name__ == "__main__":
    import argparse
    import tempfile

    from plait.kernels.bench import format_table

    parser = argparse.ArgumentParser(description="online load vs convert-then-load")
    parser.add_argument("--quick", action="store_true")
    with tempfile.TemporaryDirectory() as workdir:
        print(format_table(online_load_rows(Path(workdir), parser.parse_args().quick)))
