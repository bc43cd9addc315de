"""The paired benchmark's job, models, batches, memory accounting and contenders.

A contender is one way of training the same model on the same batches: plait ZeRO at a stage,
DeepSpeed ZeRO at that stage, FSDP2 (``fully_shard`` per block and on the root) or DDP. Every
contender is built from the same seed on every rank, so all of them start from identical
weights and their losses can be compared step by step.

Memory follows shared/benchmarks.md: the unique storages behind parameters, gradients,
optimizer state and the engine's own persistent buffers, measured after ``optimizer.step()``
(gradients still held). :func:`state_storage_bytes` walks each engine's objects and counts every
storage once, so plait and every peer are measured by the same rule.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.kernels.testing import CausalLMOutput, global_batch, rank_slice, tiny_llama

MODELS = ("tiny-llama", "tiny-llama-2l", "tiny-llama-27m", "mlp-50m")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OPTIMIZER = dict(lr=1e-3, weight_decay=0.01)  # the same AdamW options for every contender
MLP_WIDTH, MLP_DEPTH = 2496, 8  # 8 x (2496^2 + 2496) = 49.86M parameters
# DeepSpeed's default buckets are 5e8 elements (2 GB in fp32), far past these models, and stage 3
# keeps its reduce bucket allocated; 5M elements (20 MB fp32) is a size its docs' examples use.
DS_BUCKET_ELEMENTS = 5_000_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairedJob:
    """What every rank of one ``run_distributed`` call measures.

    Attributes:
        model: ``tiny-llama`` (8.4M), ``tiny-llama-2l`` (2 layers, vocab 1024: the quick stand-in), ``tiny-llama-27m``
            (27.4M: width 512, 6 layers, vocab 8192)
            or ``mlp-50m`` (49.9M).
        dtype: ``float32`` or ``bfloat16`` (compute dtype; fp32 master weights either way).
        stages: the ZeRO stages measured, one after another, each against its peers.
        timed: alternate the contenders' steps and time them (world size 2); otherwise run each
            contender alone for bytes and memory only (any world size).
        warmup: untimed steps before timing (and before counting bytes).
        steps: timed steps per contender.
        batch: global batch (sequences or MLP rows), split evenly over the ranks.
        seq: tokens per sequence (tiny-llama).
    """

    model: str
    dtype: str = "float32"
    stages: tuple[int, ...] = (1, 2, 3)
    timed: bool = True
    warmup: int = 3
    steps: int = 10
    batch: int = 8
    seq: int = 64

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"PairedJob.model={self.model!r} is unknown; use one of {MODELS}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"PairedJob.dtype={self.dtype!r} is unknown; use 'float32' or 'bfloat16'.")
        if not self.stages or any(s not in (1, 2, 3) for s in self.stages):
            raise ValueError(f"PairedJob.stages={self.stages!r} must be a non-empty tuple of 1, 2, 3.")
        if self.warmup < 1 or self.steps < 1 or self.batch < 1 or self.seq < 2:
            raise ValueError(f"PairedJob needs warmup>=1, steps>=1, batch>=1, seq>=2; got {self}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype as a torch dtype."""
        return DTYPES[self.dtype]


class ResidualFreeMLP(nn.Module):
    """The 50M-parameter MLP: ``MLP_DEPTH`` blocks of Linear(width, width) + GELU, MSE loss.

    Blocks sit in an ``nn.ModuleList`` so plait's stage 3 and FSDP2 both shard one block per unit.
    """

    def __init__(self, width: int = MLP_WIDTH, depth: int = MLP_DEPTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> CausalLMOutput:
        """inputs, targets: ``[batch, width]``; inputs are cast to the first layer's dtype."""
        x = inputs.to(self.layers[0][0].weight.dtype)
        for layer in self.layers:
            x = layer(x)
        return CausalLMOutput(logits=x, loss=F.mse_loss(x.float(), targets))


def build_model(name: str) -> nn.Module:
    """The model ``name`` (see :data:`MODELS`), initialised from seed 0 (identical on every rank)."""
    torch.manual_seed(0)
    if name == "mlp-50m":
        return ResidualFreeMLP()
    if name == "tiny-llama-2l":  # the quick stand-in: 2 layers, vocab 1024 (2.1M parameters)
        return tiny_llama(num_layers=2, vocab_size=1024)
    if name == "tiny-llama-27m":  # the Lightning benchmark's shape: width 512, 6 layers, vocab 8192
        return tiny_llama(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1376)
    return tiny_llama()


def batch_for(job: PairedJob, step: int) -> dict[str, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (the same for every contender)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if job.model == "mlp-50m":
        gen = torch.Generator().manual_seed(1_000 + step)
        whole = {"inputs": torch.randn(job.batch, MLP_WIDTH, generator=gen),
                 "targets": torch.randn(job.batch, MLP_WIDTH, generator=gen)}
    else:
        whole = global_batch(step, job.batch, job.seq)
    return rank_slice(whole, rank, world)


# ---- memory accounting ----------------------------------------------------------------------------
_WALKED = ("deepspeed", "plait", "torch.optim", "torch.distributed")


def state_storage_bytes(*roots: Any, depth: int = 8) -> int:
    """Sum of the unique storages reachable from ``roots`` (parameters and their ``.grad``, DTensor
    local shards, DeepSpeed ``ds_tensor`` partitions, and the attributes of optimizer and engine
    objects from torch, DeepSpeed and plait). Model buffers (RoPE tables) are not model state and
    are skipped; zero-sized storages (freed gathers) count nothing.
    """
    storages: dict[int, int] = {}
    seen: set[int] = set()

    def add(t: torch.Tensor) -> None:
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr():
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())

    def visit(obj: Any, left: int) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
            for attr in ("grad", "ds_tensor"):
                extra = getattr(obj, attr, None)
                if isinstance(extra, torch.Tensor):
                    add(extra)
            return
        if left == 0 or obj is None or isinstance(obj, str | int | float | bool) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                visit(p, left - 1)
            for value in vars(obj).values():
                if not isinstance(value, dict | nn.Module):  # skip _buffers/_modules: buffers are not state
                    visit(value, left - 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value, left - 1)
        elif isinstance(obj, list | tuple | set):
            for value in obj:
                visit(value, left - 1)
        elif type(obj).__module__.startswith(_WALKED) and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                visit(value, left - 1)

    for root in roots:
        visit(root, depth)
    return sum(storages.values())


# ---- contenders -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Contender:
    """One training setup.

    Attributes:
        name: the row label, e.g. ``"plait ZeRO-3"``.
        train: forward + backward + optimizer step on a batch; returns the loss (gradients kept).
        zero_grad: drop gradients before the next ``train``.
        state_roots: objects whose tensors are this setup's model state.
        model: the (wrapped) model, for plait-specific figures.
        optimizer: the user-facing optimizer.
    """

    name: str
    train: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    zero_grad: Callable[[], None]
    state_roots: tuple[Any, ...]
    model: Any = None
    optimizer: Any = None


def _plain_train(model: Any, optimizer: Any, autocast: torch.dtype | None) -> Callable:
    def train(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return train


def plait_zero(job: PairedJob, stage: int) -> Contender:
    """plait ZeRO at ``stage``: every parameter sharded at stage 3 (as FSDP2 does), gradients
    reduced in the compute dtype, defaults otherwise."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    config = ZeroConfig(stage=stage, compute_dtype=job.torch_dtype, param_persistence_threshold=0)
    model, optimizer = zero_shard(build_model(job.model), torch.optim.AdamW, config, **OPTIMIZER)
    return Contender(f"plait ZeRO-{stage}", _plain_train(model, optimizer, None), optimizer.zero_grad,
                     (model, optimizer, model.zero_engine), model, optimizer)


def ddp(job: PairedJob) -> Contender:
    """DDP with gradients as bucket views (its leanest layout); bf16 runs under autocast with fp32
    weights. torch's own all-reduce comm hook sends each bucket through ``dist.all_reduce``, where
    the worker's ``count_torch_distributed`` counts it (DDP's C++ reducer is invisible otherwise;
    ``count_ddp`` is not used because under that context it would count every bucket twice)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = nn.parallel.DistributedDataParallel(build_model(job.model), gradient_as_bucket_view=True)
    model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    autocast = job.torch_dtype if job.torch_dtype != torch.float32 else None
    return Contender("DDP", _plain_train(model, optimizer, autocast), lambda: optimizer.zero_grad(),
                     (model, optimizer), model, optimizer)


def fsdp2(job: PairedJob) -> Contender:
    """FSDP2: ``fully_shard`` on every block and on the root; bf16 through ``MixedPrecisionPolicy``
    (bf16 compute and reduction, fp32 sharded parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mixed = job.torch_dtype != torch.float32
    policy = MixedPrecisionPolicy(param_dtype=job.torch_dtype, reduce_dtype=job.torch_dtype) if mixed \
        else MixedPrecisionPolicy()
    model = build_model(job.model)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    return Contender("FSDP2", _plain_train(model, optimizer, None), lambda: optimizer.zero_grad(),
                     (model, optimizer), model, optimizer)


def deepspeed_zero(job: PairedJob, stage: int) -> Contender:
    """DeepSpeed ZeRO at ``stage`` on its CPU accelerator over the existing gloo group, with torch's
    AdamW as the client optimizer. Its shared-memory collective extension is not built: the
    transport is gloo, as for plait and the other peers (and a fresh machine skips a C++ build).

    Raises:
        Exception: whatever DeepSpeed raises where it cannot run (the caller reports it).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the process group that already exists
    world = dist.get_world_size()
    model = build_model(job.model)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    config = {
        "train_micro_batch_size_per_gpu": max(1, job.batch // world), "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True, "bf16": {"enabled": job.torch_dtype == torch.bfloat16},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": DS_BUCKET_ELEMENTS,
                              "allgather_bucket_size": DS_BUCKET_ELEMENTS},
    }
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def train(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    # engine.step() zeroes DeepSpeed's gradients itself; nothing to do before the next forward.
    return Contender(f"DeepSpeed ZeRO-{stage}", train, lambda: None, (engine, ds_optimizer), engine,
                     ds_optimizer)


def contenders_for(job: PairedJob, stage: int) -> dict[str, Callable[[], Contender]]:
    """Builders of the contenders measured at ``stage``: plait and DeepSpeed at that stage, FSDP2
    beside stage 3 (its peer there), DDP beside stage 1 (the unsharded baseline, informational)."""
    out: dict[str, Callable[[], Contender]] = {
        f"plait ZeRO-{stage}": lambda: plait_zero(job, stage),
        f"DeepSpeed ZeRO-{stage}": lambda: deepspeed_zero(job, stage),
    }
    if stage == 3:
        out["FSDP2"] = lambda: fsdp2(job)
    if stage == 1:
        out["DDP"] = lambda: ddp(job)
    return out
