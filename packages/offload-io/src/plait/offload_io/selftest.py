"""plait-offload-io's checks for ``plait selftest``: ZeRO-3 with CPU and NVMe offload on the device
(losses against the CPU path, with plait-zero-sharding's training check), pinned-memory copy
throughput of plait's aligned buffers against plain torch pinned tensors, and the peak device
memory of stage 3 + CPU offload against plain DDP.
"""

from __future__ import annotations

import importlib.util
import tempfile

import torch
from torch import nn

from plait.kernels.selftest.core import FAIL, PASS, Check, Outcome, SelftestContext, Skip
from plait.kernels.selftest.measure import device_seconds
from plait.offload_io import OffloadConfig, zero_placement
from plait.offload_io.buffers import aligned_empty


def _need_zero() -> None:
    if importlib.util.find_spec("plait.zero_sharding") is None:
        raise Skip("plait-zero-sharding is not installed (the placement plugs into it)")


def _offload(ctx: SelftestContext, device: str) -> Outcome:
    _need_zero()
    from plait.zero_sharding import selftest as zero

    with zero.exact_fp32(), tempfile.TemporaryDirectory(prefix="plait-selftest-") as path:
        want = zero.cpu_reference_losses(ctx)
        if device == "cpu":
            config = OffloadConfig(device="cpu")
        else:
            config = OffloadConfig(device="nvme", param_device="nvme", path=path)
        got = zero.zero_losses(ctx, {"stage": 3}, lambda: zero_placement(config))
    return zero.compare_losses(f"ZeRO-3 + {device} offload on {ctx.device.type}, world 1", got, want)


def check_pinned_throughput(ctx: SelftestContext) -> Outcome:
    """Host->device and device->host GB/s from plait's aligned pinned buffer vs a torch pinned tensor."""
    if ctx.device.type != "cuda":
        raise Skip("pinned-memory copies need a CUDA device (page-locking needs the driver)")
    nbytes = 1 << 30
    ours = aligned_empty(nbytes, pinned=True)
    theirs = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    rates = {}
    for name, host in (("plait", ours), ("torch", theirs)):
        rates[f"{name} h2d"] = nbytes / device_seconds(lambda h=host: dev.copy_(h, non_blocking=True), ctx, repeats=5)
        rates[f"{name} d2h"] = nbytes / device_seconds(lambda h=host: h.copy_(dev, non_blocking=True), ctx, repeats=5)
    share = min(rates["plait h2d"] / rates["torch h2d"], rates["plait d2h"] / rates["torch d2h"])
    text = ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in rates.items())
    return Outcome(PASS if share >= 0.95 else FAIL, "plait / torch pinned GB/s (worse direction)", share,
                   ">= 0.95", f"1 GiB copies; {text}")


def _peak(ctx: SelftestContext, run) -> int | None:
    if ctx.device.type != "cuda":
        run()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    run()
    return torch.cuda.max_memory_allocated(ctx.device) - base


def check_offload_memory(ctx: SelftestContext) -> Outcome:
    """Peak device memory of one training step: stage 3 + CPU offload against plain DDP (AdamW, fp32)."""
    _need_zero()
    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding import selftest as zero

    width, layers, rows = ctx.pick((8192, 24, 16), (32, 2, 4))  # 1.6B parameters: DDP + AdamW ~ 26 GB
    data = zero.batches(width, rows, ctx.device)[:2]

    def build() -> nn.Module:
        return zero.mlp(width, layers, device=ctx.device, build_on_device=True)

    def ddp() -> None:
        with zero.world_of_one(ctx):
            model = nn.parallel.DistributedDataParallel(build())
            zero.train_losses(model, torch.optim.AdamW(model.parameters(), lr=zero.LR), data)
            del model

    def offloaded() -> None:
        with zero.world_of_one(ctx):
            placement = zero_placement(OffloadConfig(device="cpu"))
            try:
                model, opt = zero_shard(build(), torch.optim.AdamW, ZeroConfig(stage=3), placement=placement,
                                        lr=zero.LR)
                zero.train_losses(model, opt, data)
                del model, opt
            finally:
                placement.close()

    peak_ddp = _peak(ctx, ddp)
    ctx.deadline.check("the offloaded run")
    peak_off = _peak(ctx, offloaded)
    params = (width * width + width) * layers + width + 1
    if peak_ddp is None:
        return Outcome(PASS, "DDP peak / offload peak", None, "",
                       f"dry run: both runs made ({params} parameters); peak device memory is a GPU figure")
    ratio = peak_ddp / max(peak_off, 1)
    return Outcome(PASS if ratio >= 2 else FAIL, "DDP peak / offload peak", ratio, ">= 2",
                   f"{params / 1e9:.2f}B parameters, 2 steps: DDP {peak_ddp / 2**30:.1f} GiB, "
                   f"stage 3 + CPU offload {peak_off / 2**30:.1f} GiB")


def checks(ctx: SelftestContext) -> list[Check]:
    """plait-offload-io's checks (entry point ``plait.selftest`` ``offload-io``)."""
    del ctx
    return [
        Check("offload-io/zero3 cpu offload", lambda c: _offload(c, "cpu"), 60),
        Check("offload-io/zero3 nvme offload", lambda c: _offload(c, "nvme"), 60),
        Check("offload-io/pinned throughput", check_pinned_throughput, 30),
        Check("offload-io/peak memory vs DDP", check_offload_memory, 120),
    ]
