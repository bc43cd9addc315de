"""The training workload the step benchmarks share: tiny-llama on the shared corpus, fp32 CPU.

Also the per-variant process of the memory figures: ``python -m
plait.offload_io.benchmarks.workload VARIANT STEPS [PATH]`` (VARIANT: memory, cpu, nvme, deepspeed,
infinity) trains tiny-llama for STEPS steps with
the variant's optimizer and prints one JSON line (resident set after the imports, after the
model, after training, the peak, and the model-state bytes it accounts for), so each variant's
resident memory is its own and it runs exactly the model, batch and optimizer of the timings.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from plait.kernels.bench import rss_bytes
from plait.offload_io.optimizer import OffloadedOptimizer

LR = 1e-3
WEIGHT_DECAY = 0.01
BATCH, SEQ = 4, 64
SUB_GROUP_SIZE = 1 << 20  # ~9 sub-groups on tiny-llama: enough to show read/step/write overlap


def build_model(seed: int = 0) -> torch.nn.Module:
    """tiny-llama (about 8.4M parameters) with a fixed seed."""
    from plait.kernels.testing import tiny_llama

    torch.manual_seed(seed)
    return tiny_llama()


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step`` from the shared corpus."""
    from plait.kernels.testing import global_batch

    return global_batch(step, BATCH, SEQ)


def make_optimizer(variant: str, model: torch.nn.Module, path: str | None = None):
    """One optimizer per benchmark variant.

    Args:
        variant: ``"memory"`` (torch fused AdamW), ``"cpu"`` / ``"nvme"`` (OffloadedOptimizer),
            ``"deepspeed"`` (DeepSpeedCPUAdam, which JIT-builds its op on first use).
        model: the model.
        path: directory for ``"nvme"``.

    Returns:
        The optimizer.
    """
    params = model.parameters()
    if variant == "memory":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if variant == "cpu":  # nothing streams, so the default (larger) sub-groups: less per-group overhead
        return OffloadedOptimizer(params, torch.optim.AdamW, device="cpu", lr=LR, weight_decay=WEIGHT_DECAY)
    if variant == "nvme":
        return OffloadedOptimizer(params, torch.optim.AdamW, device="nvme", path=path,
                                  sub_group_size=SUB_GROUP_SIZE, lr=LR, weight_decay=WEIGHT_DECAY)
    if variant == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    raise ValueError(f"unknown variant {variant!r}; use memory, cpu, nvme, deepspeed or infinity.")


def make_zero3_offload(model: torch.nn.Module, device: str, path: str | None = None
                       ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """plait-zero-sharding stage 3 on one process with parameter shards, fp32 masters and AdamW
    state all on ``device``: ``"nvme"`` (files under ``path``, ZeRO-Infinity) or ``"cpu"`` (host
    memory, the configuration of DeepSpeed's row beside it). Needs plait-zero-sharding.

    Returns:
        ``(model, optimizer)``; ``optimizer.close()`` closes the placement (deletes its files).
    """
    import torch.distributed as dist

    from plait.kernels.testing import free_port
    from plait.offload_io.config import OffloadConfig
    from plait.offload_io.zero_placement import zero_placement
    from plait.zero_sharding import ZeroConfig, zero_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    placement = zero_placement(OffloadConfig(device=device, param_device=device, path=path,
                                             sub_group_size=SUB_GROUP_SIZE if device == "nvme" else 1 << 22))
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, lr=LR,
                                  weight_decay=WEIGHT_DECAY)
    optimizer.close = placement.close
    return model, optimizer


class DeepSpeedOffload:
    """DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on the CPU (its
    DeepSpeedCPUAdam steps), one process over the existing gloo group; :func:`train_step` drives
    it through ``engine.backward``/``engine.step``, as DeepSpeed requires.

    Raises:
        Exception: whatever DeepSpeed raises where it cannot run (the caller reports it).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo, as for plait
        for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)  # what torchrun would set for this one process
        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                  "offload_param": {"device": "cpu", "pin_memory": False}},
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def close(self) -> None:
        """Nothing to delete (no files)."""


def zero_infinity_available() -> tuple[bool, str]:
    """Whether plait-zero-sharding is installed (the ZeRO-Infinity rows need it)."""
    import importlib.util

    if importlib.util.find_spec("plait.zero_sharding") is None:
        return False, "needs plait-zero-sharding (pip install plait-zero-sharding)"
    return True, ""


def train_step(model: torch.nn.Module, optimizer, step: int) -> tuple[float, float]:
    """One forward, backward, step and zero_grad.

    Returns:
        (seconds of the whole step, seconds of ``optimizer.step()`` alone).
    """
    data = batch(step)
    if isinstance(optimizer, DeepSpeedOffload):
        engine = optimizer.engine
        start = time.perf_counter()
        engine.backward(engine(data["input_ids"], labels=data["labels"]).loss)
        mid = time.perf_counter()
        engine.step()  # also zeroes DeepSpeed's gradients
        end = time.perf_counter()
        return end - start, end - mid
    start = time.perf_counter()
    loss = model(data["input_ids"], labels=data["labels"]).loss
    loss.backward()
    mid = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    return end - start, end - mid


def deepspeed_cpu_adam_ready() -> tuple[bool, str]:
    """Whether DeepSpeedCPUAdam can run here without a long JIT build (its op already built).

    Returns:
        (ready, reason when not).
    """
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as exc:  # noqa: BLE001 - any import failure means "peer unavailable"
        return False, f"deepspeed does not import: {type(exc).__name__}"
    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        return False, "DeepSpeed's cpu_adam op is not compatible with this machine"
    from torch.utils.cpp_extension import _get_build_directory

    built = os.path.join(_get_build_directory(builder.name, verbose=False), f"{builder.name}.so")
    if not os.path.exists(built):
        return False, ("DeepSpeed's cpu_adam op is not built (a C++ build of minutes; "
                       f"`PLAIT_BUILD_DEEPSPEED_OPS=1 bash ci/setup.sh` builds it once, at {built})")
    return True, ""


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state in memory (for an offloaded optimizer: its store's slots)."""
    if hasattr(optimizer, "resident_state_bytes"):
        return optimizer.resident_state_bytes
    store = getattr(getattr(getattr(optimizer, "engine", None), "placement", None), "store", None)
    if store is not None:  # ZeRO-Infinity: the placement's store slots
        return store.resident_bytes
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))


def model_state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Parameters + gradients + optimizer state (+ store slots) held in memory, in bytes."""
    engine = getattr(model, "zero_engine", None)
    if engine is not None:  # ZeRO-Infinity: resident units and loaded shards; fp32 gradient shards
        params = sum(unit.state_bytes()["params"] for unit in engine.units)
        grads = sum(unit.shard_numel * 4 for unit in engine.units)
        return params + grads + optimizer_state_bytes(optimizer)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = params  # gradients are resident during the step in every variant
    return params + grads + optimizer_state_bytes(optimizer)


def main(argv: list[str]) -> int:
    """Run the variant and print its JSON line."""
    variant, steps = argv[0], int(argv[1])
    path = argv[2] if len(argv) > 2 else None
    torch.set_num_threads(1)
    # Pay the one-time costs both variants share before the baseline: fused AdamW pulls in a
    # large part of torch on first use, which would otherwise count as "optimizer memory".
    warm = torch.zeros(8, requires_grad=True)
    warm.grad = torch.ones(8)
    torch.optim.AdamW([warm], fused=True).step()
    rss_imports, _ = rss_bytes()
    model = build_model()
    rss_model, _ = rss_bytes()
    if variant == "infinity":
        model, optimizer = make_zero3_offload(model, "nvme", path)
    else:
        optimizer = make_optimizer(variant, model, path)
    for step in range(steps):
        train_step(model, optimizer, step)
    rss_after, rss_peak = rss_bytes()
    print(json.dumps({"variant": variant, "rss_imports": rss_imports, "rss_model": rss_model,
                      "rss_after": rss_after, "rss_peak": rss_peak,
                      "model_state_bytes": model_state_bytes(model, optimizer),
                      "optimizer_state_bytes": optimizer_state_bytes(optimizer)}))
    if hasattr(optimizer, "close"):
        optimizer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
