"""plait-zero-sharding's checks for ``plait selftest``: ZeRO stages 1/2/3 and ZeRO++ training on the
device found, at world size 1 (NCCL on a GPU, gloo on the dry run), with losses compared to the
same model trained by plain torch on the CPU; and ZeRO-3 at world size 2 on the one device, where
the shards, reduce-scatters and all-gathers are real. NCCL refuses two ranks on one GPU ("Duplicate
GPU detected"), so that check falls back to gloo, which carries CUDA tensors through the host.
plait-offload-io's checks reuse :func:`world_of_one` and :func:`train_losses` for its placements.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.selftest.core import FAIL, PASS, Check, Outcome, SelftestContext, Skip
from plait.kernels.tolerances import tolerance

STEPS = 5
LR = 1e-3


@contextlib.contextmanager
def world_of_one(ctx: SelftestContext) -> Iterator[str]:
    """A one-rank default process group on ``ctx.device`` (NCCL on CUDA, gloo on the CPU), destroyed on exit.

    Yields:
        The backend's name.

    Raises:
        RuntimeError: a process group already exists (the selftest runs checks one at a time).
    """
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; run plait selftest in its own process")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device.index or 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def mlp(width: int, layers: int, *, seed: int = 0, device: torch.device | str = "cpu",
        build_on_device: bool = False) -> nn.Module:
    """The model the checks train: ``layers`` blocks of Linear + GELU, then a Linear head (fp32).

    Built on the CPU and moved (the same weights as the CPU path's, whatever the device), or with
    ``build_on_device`` initialised on ``device`` directly (fast for the large memory check, whose
    weights need not match anything).
    """
    torch.manual_seed(seed)
    with torch.device(device if build_on_device else "cpu"):
        blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]
        model = nn.Sequential(*blocks, nn.Linear(width, 1))
    return model.to(device)


def batches(width: int, rows: int, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One fixed batch, ``STEPS`` times (made on the CPU from a fixed seed, then moved): the loss falls."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, width, generator=gen).to(device), torch.randn(rows, 1, generator=gen).to(device)
    return [(x, y)] * STEPS


def train_losses(model: nn.Module, optimizer: torch.optim.Optimizer, data) -> list[float]:
    """``STEPS`` steps of MSE regression; the loss of each."""
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def shape(ctx: SelftestContext) -> tuple[int, int, int]:
    """``(width, layers, rows)``: 8 x 4096 (134M parameters) on a GPU, tiny on the dry run."""
    return ctx.pick((4096, 8, 64), (32, 2, 8))


def cpu_reference_losses(ctx: SelftestContext) -> list[float]:
    """The same model and batches trained by plain torch AdamW on the CPU, in fp32."""
    width, layers, rows = shape(ctx)
    model = mlp(width, layers)
    return train_losses(model, torch.optim.AdamW(model.parameters(), lr=LR), batches(width, rows, "cpu"))


def compare_losses(name: str, got: list[float], want: list[float], *, rtol: float | None = None,
                   why: str = "") -> Outcome:
    """PASS when every step's loss is within the bound of the CPU path's (the ``zero_losses_vs_cpu``
    tolerance, or ``rtol`` where the run quantizes on purpose); the value is the worst ratio to it."""
    bound = tolerance("zero_losses_vs_cpu", torch.float32) if rtol is None else None
    worst = 0.0
    for a, e in zip(got, want, strict=True):
        limit = bound.atol + bound.rtol * abs(e) if bound else rtol * abs(e)
        worst = max(worst, abs(a - e) / limit)
    note = f"{name}: {len(got)} steps, losses {got[0]:.4g} -> {got[-1]:.4g} (CPU path {want[0]:.4g} -> {want[-1]:.4g})"
    note += f"; {why}" if why else ""
    return Outcome(PASS if worst <= 1 else FAIL, "max loss diff / bound", worst, "<= 1", note)


def zero_losses(ctx: SelftestContext, config_kwargs: dict, placement_factory: Callable | None = None) -> list[float]:
    """Train the check model with ``zero_shard`` on ``ctx.device`` at world size 1.

    Args:
        ctx: the context.
        config_kwargs: :class:`~plait.zero_sharding.ZeroConfig` fields.
        placement_factory: builds the ``placement=`` (an offload placement) or None.

    Returns:
        The losses of ``STEPS`` steps.
    """
    from plait.zero_sharding import ZeroConfig, zero_shard

    width, layers, rows = shape(ctx)
    with world_of_one(ctx):
        placement = placement_factory() if placement_factory else None
        try:
            model, optimizer = zero_shard(mlp(width, layers, device=ctx.device), torch.optim.AdamW,
                                          ZeroConfig(**config_kwargs), placement=placement, lr=LR)
            return train_losses(model, optimizer, batches(width, rows, ctx.device))
        finally:
            if placement is not None:
                placement.close()


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """TF32 off for the duration: the comparison with the CPU path is an fp32 one."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _stage(stage: int) -> Callable[[SelftestContext], Outcome]:
    def run(ctx: SelftestContext) -> Outcome:
        with exact_fp32():
            want = cpu_reference_losses(ctx)
            ctx.deadline.check(f"ZeRO-{stage}")
            got = zero_losses(ctx, {"stage": stage})
        return compare_losses(f"ZeRO-{stage} fp32 on {ctx.device.type}, world 1", got, want)
    return run


def check_zeropp(ctx: SelftestContext) -> Outcome:
    """ZeRO++ (int8 weight gathers, int4 gradient reduction) at stage 3: quantization is on purpose, so
    the losses are held to the 5% of the CPU path that plait-zero-sharding's ZeRO++ training test uses."""
    with exact_fp32():
        want = cpu_reference_losses(ctx)
        got = zero_losses(ctx, {"stage": 3, "zeropp": True})
    return compare_losses(f"ZeRO++ stage 3 on {ctx.device.type}, world 1", got, want, rtol=0.05,
                          why="qwZ int8 / qgZ int4: bound 5% of the loss")


def two_rank_losses(device_type: str, width: int, layers: int, rows: int) -> list[float]:
    """One rank of the world-size-2 check (run by ``run_distributed``): ZeRO-3 on its half of each
    batch, on ``cuda:0`` (both ranks share it) or the CPU; the losses averaged over the ranks."""
    from plait.zero_sharding import ZeroConfig, zero_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with exact_fp32():
        model, optimizer = zero_shard(mlp(width, layers, device=device), torch.optim.AdamW,
                                      ZeroConfig(stage=3), lr=LR)
        losses = []
        for x, y in batches(width, rows, device):
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            report = loss.detach().clone()
            dist.all_reduce(report)
            losses.append(report.item() / world)
    return losses


def check_two_ranks(ctx: SelftestContext) -> Outcome:
    """ZeRO-3 at world size 2 on the one device against the CPU path on the whole batch: NCCL where it
    accepts two ranks on one GPU, else gloo (on the dry run, gloo on the CPU)."""
    from plait.kernels.testing import DistributedTestError, run_distributed

    width, layers, rows = shape(ctx)
    with exact_fp32():
        want = cpu_reference_losses(ctx)
    args = (ctx.device.type, width, layers, rows)
    refused = ""
    if ctx.device.type == "cuda":
        try:
            got = run_distributed(two_rank_losses, 2, *args, backend="nccl", timeout=60)[0]
            return compare_losses("ZeRO-3 fp32, world 2 on one GPU over nccl", got, want)
        except DistributedTestError as exc:
            refused = f"nccl refused two ranks on one GPU ({_last_line(str(exc))}); "
    ctx.deadline.check("ZeRO-3 world 2 over gloo")
    try:
        got = run_distributed(two_rank_losses, 2, *args, backend="gloo", timeout=60)[0]
    except DistributedTestError as exc:
        if refused:
            raise Skip(f"{refused}gloo failed too: {_last_line(str(exc))}") from exc
        raise
    return compare_losses(f"ZeRO-3 fp32, world 2 on one {ctx.device.type} device over gloo", got, want,
                          why=refused.rstrip("; "))


def _last_line(text: str) -> str:
    """The last non-empty line of an error (the exception itself), shortened for a table note."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else "no message")[:200]


def checks(ctx: SelftestContext) -> list[Check]:
    """plait-zero-sharding's checks (entry point ``plait.selftest`` ``zero-sharding``)."""
    del ctx
    return [Check(f"zero-sharding/zero{stage}", _stage(stage), 40) for stage in (1, 2, 3)] + [
        Check("zero-sharding/zero++", check_zeropp, 40), Check("zero-sharding/zero3-world2", check_two_ranks, 150)]
