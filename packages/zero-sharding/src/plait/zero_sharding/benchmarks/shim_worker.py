"""What every rank runs in ``plait bench deepspeed-shim``: one DeepSpeed script, two ``deepspeed`` modules.

The "script" is the loop a DeepSpeed user writes: ``engine, optimizer, _, scheduler =
deepspeed.initialize(model=..., model_parameters=..., config=CONFIG)`` and then, per batch,
``loss = engine(**batch).loss; engine.backward(loss); engine.step()``. It runs twice in the same
ranks, once with the real DeepSpeed (0.19.8, CPU accelerator, gloo) and once with
:mod:`plait.zero_sharding.deepspeed` (the module ``python -m plait.zero_sharding.deepspeed`` puts in
its place), both from the same seed, on the same batches, with the same config dict. Their steps
alternate in ABBA order (:func:`plait.kernels.bench.interleaved_timing`), so load drifts fall on both
alike; every step's loss is kept so the suite can hold them equal.

The configs are those the HF and DeepSpeed examples ship (``ds_config_zero2.json``,
``ds_config_zero3.json``), with their optimizer/scheduler blocks: ZeRO-2, ZeRO-3, and ZeRO-3 with
``offload_optimizer`` and ``offload_param`` on the CPU. torch's AdamW runs on both sides
(``torch_adam``; DeepSpeed's own CPU Adam is a C++ build, and ``zero_force_ds_cpu_optimizer: false``
lets DeepSpeed offload torch's).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.bench import TimingStats, interleaved_timing
from plait.zero_sharding.benchmarks.paired_setup import MODELS, batch_for, build_model

_ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                      "torch_adam": True}}
_COMMON = {"gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "optimizer": _ADAMW,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 5}},
           "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "wall_clock_breakdown": False}
_ZERO2 = {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True}
_ZERO3 = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
          "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6,
          "stage3_param_persistence_threshold": 100, "stage3_max_live_parameters": 1e9,
          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
_CPU = {"device": "cpu", "pin_memory": True}
#: name -> ``zero_optimization`` block; the rest of each config is :data:`_COMMON` plus the batch.
ZERO_BLOCKS: dict[str, dict[str, Any]] = {
    "ZeRO-2": _ZERO2,
    "ZeRO-3": _ZERO3,
    "ZeRO-3 + CPU offload": {**_ZERO3, "offload_optimizer": _CPU, "offload_param": _CPU},
}


def ds_config(name: str, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed config ``name`` (a key of :data:`ZERO_BLOCKS`) with ``micro_batch`` per rank.

    Raises:
        ValueError: an unknown name.
    """
    if name not in ZERO_BLOCKS:
        raise ValueError(f"ds_config name={name!r} is unknown; use one of {sorted(ZERO_BLOCKS)}.")
    return copy.deepcopy({**_COMMON, "train_micro_batch_size_per_gpu": micro_batch,
                          "zero_optimization": ZERO_BLOCKS[name]})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShimJob:
    """What every rank of one ``run_distributed`` call measures.

    Attributes:
        model: a model of :data:`plait.zero_sharding.benchmarks.paired_setup.MODELS` (fp32).
        configs: names from :data:`ZERO_BLOCKS`, measured one after another.
        warmup: untimed steps of each side first (their losses are compared too).
        steps: timed steps of each side.
        batch: global batch (sequences), split evenly over the ranks.
        seq: tokens per sequence.
    """

    model: str = "tiny-llama"
    configs: tuple[str, ...] = tuple(ZERO_BLOCKS)
    warmup: int = 3
    steps: int = 17
    batch: int = 8
    seq: int = 64

    def __post_init__(self) -> None:
        if self.model not in MODELS or self.model == "mlp-50m":
            raise ValueError(f"ShimJob.model={self.model!r}: use a tiny-llama model of {MODELS}.")
        unknown = [name for name in self.configs if name not in ZERO_BLOCKS]
        if not self.configs or unknown:
            raise ValueError(f"ShimJob.configs={self.configs!r}: use names of {sorted(ZERO_BLOCKS)}.")
        if self.warmup < 1 or self.steps < 1 or self.batch < 2 or self.seq < 2:
            raise ValueError(f"ShimJob needs warmup>=1, steps>=1, batch>=2, seq>=2; got {self}.")


def real_deepspeed() -> Any:
    """DeepSpeed itself on its CPU accelerator, its shared-memory op build skipped (gloo carries all)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def plait_deepspeed() -> Any:
    """plait's ``deepspeed`` module (what ``import deepspeed`` gives under plait's launcher)."""
    import plait.zero_sharding.deepspeed as shim

    return shim


def the_script(deepspeed: Any, job: ShimJob, config: dict[str, Any]) -> tuple[Callable[[], None], list[float]]:
    """The user's script with ``deepspeed`` as its module: initialize, then one step per call.

    Returns:
        ``(step, losses)``: ``step()`` trains on the next batch and appends its loss to ``losses``.
    """
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=copy.deepcopy(config))
    losses: list[float] = []

    def step() -> None:
        loss = engine(**batch_for(job, len(losses))).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))

    return step, losses


def _thread_cpu(step: Callable[[], None], into: list[float]) -> Callable[[], None]:
    def timed() -> None:
        start = time.thread_time()
        step()
        into.append(time.thread_time() - start)

    return timed


def measure(job: ShimJob, name: str) -> dict[str, Any]:
    """One config: both sides built, stepped alternately, timed (wall and this thread's CPU).

    Returns:
        ``{"wall": side -> TimingStats, "cpu": side -> TimingStats, "losses": side -> [float]}``
        with sides ``"plait"`` and ``"DeepSpeed"``.
    """
    config = ds_config(name, job.batch // dist.get_world_size())
    sides = {"plait": plait_deepspeed(), "DeepSpeed": real_deepspeed()}
    steps, losses, cpu = {}, {}, {}
    for side, module in sides.items():
        steps[side], losses[side] = the_script(module, job, config)
        cpu[side] = []
    wall = interleaved_timing({side: _thread_cpu(steps[side], cpu[side]) for side in sides},
                              warmup=job.warmup, steps=job.steps)
    cpu_stats = {side: TimingStats.of(samples[job.warmup:]) for side, samples in cpu.items()}
    return {"wall": wall, "cpu": cpu_stats, "losses": losses}


def run_shim(job: ShimJob) -> dict[str, dict[str, Any]]:
    """Every rank's entry point: :func:`measure` each config of ``job`` in turn.

    Returns:
        config name -> :func:`measure`'s result for this rank.
    """
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return {name: measure(job, name) for name in job.configs}
