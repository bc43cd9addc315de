"""One rank of the benchmark: every variant trains the same model, in alternating blocks of steps.

The ``zero{1,2}_*`` variants shard the model with plait-zero-sharding (ZeRO stage 1 or 2) and
compose the 1-bit optimizers through its extension points. Run by
:mod:`plait.onebit_optim.benchmarks.suite` as
``python -m plait.onebit_optim.benchmarks.worker '<json spec>'`` (inside a network namespace when
the link is emulated). Each variant is a model and an optimizer of its own; rounds go A B C ...
A B C, so every variant sees the same machine load. A sample is one *block* of ``block`` steps
(0/1 Adam synchronises once per block after its warm-up, so a block holds a whole cycle), and the
figure is seconds per step. Bytes are the ledger's volume per step (an all-reduce counts twice, as
RS + AG, like the formulas): plait's optimizers
through plait's collectives, DDP through :func:`~plait.kernels.collectives.count_ddp` and the
comm hooks through :func:`~plait.kernels.collectives.count_torch_distributed`.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from plait.kernels import collectives
from plait.kernels.testing import global_batch, rank_slice, tiny_llama
from plait.onebit_optim import (
    OnebitAdam,
    OnebitAdamConfig,
    OnebitLamb,
    OnebitLambConfig,
    ZeroOneAdam,
    ZeroOneAdamConfig,
)

LR = 3e-4
VARIANTS = ("ddp_adamw", "ddp_fp16_hook", "ddp_powersgd", "onebit_adam", "zero_one_adam", "onebit_lamb")
ONEBIT = ("onebit_adam", "zero_one_adam", "onebit_lamb")
# Under plait-zero-sharding (launched per stage, each against ZeRO + AdamW of the same stage);
# onebit_adam_update: 1-bit Adam with OnebitAdamConfig(zero_param_sync="update"), no post-step gather.
ZERO_VARIANTS = tuple(f"zero{stage}_{name}" for stage in (1, 2)
                      for name in ("adamw", *ONEBIT, "onebit_adam_update"))


def onebit_optimizer(name: str, spec: dict[str, Any]) -> tuple[type, Any, dict[str, Any]]:
    """The class, config and extra constructor arguments of a 1-bit variant.

    1-bit Adam/LAMB: frozen after step 2. 0/1 Adam: the variance updated (full precision) at each
    of the first ``block`` steps (the untimed warm-up block), then frozen; the sync interval doubles
    every step up to one per block; ``beta2 = 0.99``. Why 0.99: 0/1 Adam has no bias correction, so
    with 0.999 a variance of four updates is 0.4% of its size and the steps are ~16x Adam's (the
    26.3M model diverged to NaN within 10 steps at 3e-4, in the 21:07 run too); with 0.99 it is 4%.
    """
    if name == "onebit_adam":
        return OnebitAdam, OnebitAdamConfig(freeze_step=2), {}
    if name == "onebit_adam_update":  # under ZeRO only: the decoded update applied on every rank
        return OnebitAdam, OnebitAdamConfig(freeze_step=2, zero_param_sync="update"), {}
    if name == "onebit_lamb":
        return OnebitLamb, OnebitLambConfig(freeze_step=2), {}
    return ZeroOneAdam, ZeroOneAdamConfig(var_freeze_step=spec["block"], var_update_scaler=spec["block"],
                                          local_step_scaler=1, local_step_clipper=spec["block"]), {"betas": (0.9, 0.99)}


def build(name: str, spec: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The model (seeded identically on every rank) and optimizer of one variant."""
    torch.manual_seed(0)
    model = tiny_llama(**spec["model"])
    if name in ZERO_VARIANTS:
        return _zero(name, model, spec)
    if name in ONEBIT:
        cls, config, extra = onebit_optimizer(name, spec)
        return model, cls(list(model.parameters()), lr=LR, config=config, **extra)
    # PowerSGD chains collectives in its futures' callbacks; with several DDP buckets the chains of
    # different buckets interleave in a different order on each rank, which gloo cannot match (the
    # "Received data size doesn't match expected size" abort of the 21:07 run). One bucket for the
    # whole model keeps the order; its communication is small enough not to need overlap.
    bucket_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
    ddp = DistributedDataParallel(model, **({"bucket_cap_mb": bucket_mb} if name == "ddp_powersgd" else {}))
    if name == "ddp_adamw":
        collectives.count_ddp(ddp)
    elif name == "ddp_fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "ddp_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)


def _zero(name: str, model: torch.nn.Module, spec: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """``zero{stage}_{optimizer}``: the model sharded by plait-zero-sharding (imported here: it is
    not a dependency of this package; a missing one becomes the variant's "could not run" row)."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    stage, base = int(name[4]), name[6:]
    config = ZeroConfig(stage=stage)
    if base == "adamw":
        return zero_shard(model, torch.optim.AdamW, config, lr=LR, weight_decay=0.0)
    cls, onebit_config, extra = onebit_optimizer(base, spec)
    return zero_shard(model, cls, config, lr=LR, onebit_config=onebit_config, **extra)


def run_block(model: torch.nn.Module, optimizer: Any, first_step: int, spec: dict[str, Any]) -> dict[str, Any]:
    """``block`` training steps; their wall time, logical bytes and losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    with collectives.ByteLedger() as ledger, collectives.count_torch_distributed():
        start = time.perf_counter()
        for step in range(first_step, first_step + spec["block"]):
            data = rank_slice(global_batch(step, spec["batch"], spec["seq"]), rank, world)
            loss = model(**data).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": ledger.volume(), "losses": losses}


def main(spec: dict[str, Any]) -> None:
    """Train every variant in alternating blocks and write rank 0's figures to ``spec["out"]``."""
    torch.set_num_threads(spec.get("threads", 1))
    dist.init_process_group("gloo", init_method=f"tcp://{spec['addr']}:{spec['port']}", rank=spec["rank"],
                            world_size=spec["world"], timeout=datetime.timedelta(seconds=spec["timeout"]))
    try:
        results: dict[str, Any] = {}
        built = {}
        for name in spec["variants"]:
            try:
                built[name] = build(name, spec)
                numel = sum(p.numel() for p in built[name][0].parameters())
                results[name] = {"blocks": [], "error": None, "numel": numel}
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run becomes a row saying why
                results[name] = {"blocks": [], "error": f"{type(exc).__name__}: {exc}"}
        for block in range(spec["warmup_blocks"] + spec["blocks"]):
            for name, (model, optimizer) in built.items():
                if results[name]["error"]:
                    continue
                try:
                    out = run_block(model, optimizer, block * spec["block"], spec)
                except Exception as exc:  # noqa: BLE001 - same; the other ranks fail the same way
                    results[name]["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    continue
                out["timed"] = block >= spec["warmup_blocks"]
                results[name]["blocks"].append(out)
        if spec["rank"] == 0:
            with open(spec["out"], "w") as handle:
                json.dump(results, handle)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
