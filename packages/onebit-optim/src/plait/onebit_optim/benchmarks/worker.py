"""One rank of the benchmark: every variant trains the same model, in alternating blocks of steps.

Run by :mod:`plait.onebit_optim.benchmarks.suite` as
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


def build(name: str, spec: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The model (seeded identically on every rank) and optimizer of one variant."""
    torch.manual_seed(0)
    model = tiny_llama(**spec["model"])
    params = list(model.parameters())
    if name == "onebit_adam":
        return model, OnebitAdam(params, lr=LR, config=OnebitAdamConfig(freeze_step=2))
    if name == "onebit_lamb":
        return model, OnebitLamb(params, lr=LR, config=OnebitLambConfig(freeze_step=2))
    if name == "zero_one_adam":
        # Variance frozen after step 2; the sync interval doubles every step up to one per block.
        return model, ZeroOneAdam(params, lr=LR, config=ZeroOneAdamConfig(
            var_freeze_step=2, var_update_scaler=1, local_step_scaler=1, local_step_clipper=spec["block"]))
    ddp = DistributedDataParallel(model)
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
