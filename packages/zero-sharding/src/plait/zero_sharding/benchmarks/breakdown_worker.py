"""What every rank runs for ``plait bench zero-breakdown``: where one training step's time goes.

The contenders (plait ZeRO-2, plait ZeRO-3, FSDP2, DDP) live in the same ranks, are built from
the same seed and train on the same batches. Three kinds of figure are taken, each chosen for
how little load on a shared machine disturbs it:

* **Clocks, alternated.** Rounds of one step per contender in A B C D / D C B A order (ABBA), each
  step read on three clocks: wall, this thread's CPU time (``time.thread_time``: compute, copies,
  Python, the optimizer) and the process's CPU time minus the thread's (gloo's worker threads:
  the communication work). ``wall - thread CPU`` is the time the training thread was blocked:
  waiting on communication, or off the CPU because other jobs ran.
* **A profile of each step's main thread** (``torch.profiler``, separate alternated rounds so the
  profiler's cost never enters the clocks above): self time per category (see
  :func:`categorise`) and counts that do not depend on load at all (allocations, copy calls,
  elements copied).
* **The communication wall**: the same collectives (by kind and bytes, from the byte ledger of one
  counted step) issued alone and waited for, so ``comm wall - exposed`` is what overlapped.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from plait.kernels.collectives import ByteLedger, count_torch_distributed
from plait.zero_sharding.benchmarks.paired_setup import Contender, PairedJob, batch_for, ddp, fsdp2, plait_zero

CONTENDERS: dict[str, Callable[[PairedJob], Contender]] = {
    "plait ZeRO-2": lambda job: plait_zero(job, 2),
    "plait ZeRO-3": lambda job: plait_zero(job, 3),
    "FSDP2": fsdp2,
    "DDP": ddp,
}
CATEGORIES = ("compute", "copies", "optimizer", "comm_calls", "hooks", "other")
# Ops that move or allocate memory rather than compute: flat-buffer copies in and out, casts,
# concatenations, fills and allocations.
_COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::cat", "aten::clone", "aten::fill_", "aten::zero_",
             "aten::empty", "aten::empty_strided", "aten::zeros", "aten::new_empty", "aten::new_zeros",
             "aten::resize_", "aten::index_select", "aten::_foreach_copy_", "aten::split_with_sizes_copy",
             "aten::chunk_cat", "aten::narrow_copy", "aten::set_"}
_ALLOC_OPS = {"aten::empty", "aten::empty_strided", "aten::new_empty"}
# Framework ranges: the self time of these is the package's own Python (hooks, bookkeeping).
_HOOK_PREFIXES = ("plait::zero::", "FSDP::", "fsdp::", "DistributedDataParallel.")
_WAIT_PREFIXES = ("plait::zero::wait_",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BreakdownJob:
    """What one ``run_distributed`` call of the breakdown measures.

    Attributes:
        model: a :data:`~.paired_setup.MODELS` name.
        dtype: ``float32`` or ``bfloat16``.
        batch, seq: the global batch (sequences x tokens), split over the ranks.
        warmup: untimed steps per contender first.
        rounds: alternated rounds on the clocks (two steps per contender each: ABBA).
        profiled: alternated profiled steps per contender.
        contenders: which of :data:`CONTENDERS` to run, in this order.
    """

    model: str
    dtype: str = "float32"
    batch: int = 4
    seq: int = 128
    warmup: int = 2
    rounds: int = 5
    profiled: int = 2
    contenders: tuple[str, ...] = tuple(CONTENDERS)

    def __post_init__(self) -> None:
        unknown = [name for name in self.contenders if name not in CONTENDERS]
        if unknown or not self.contenders:
            raise ValueError(f"BreakdownJob.contenders={self.contenders!r}: use a non-empty tuple of "
                             f"{tuple(CONTENDERS)}.")
        if self.warmup < 1 or self.rounds < 1 or self.profiled < 1:
            raise ValueError(f"BreakdownJob needs warmup>=1, rounds>=1, profiled>=1; got {self}.")

    def paired(self) -> PairedJob:
        """The :class:`PairedJob` the contenders are built from."""
        return PairedJob(model=self.model, dtype=self.dtype, stages=(3,), batch=self.batch, seq=self.seq)


def categorise(events: Any) -> dict[str, float]:
    """Split the main thread's profiled time into :data:`CATEGORIES` (microseconds), with counts.

    ``optimizer`` is everything under the inner optimizer's ``Optimizer.step#<torch optimizer>``
    range; outside it, ``compute`` is the self time of aten ops and autograd nodes other than
    copies and allocations (``copies``), ``comm_calls`` the self time of ``c10d::`` ops and plait's
    ``wait_*`` ranges (communication the thread waited for), ``hooks`` the self time of the
    frameworks' own ranges (plait's, FSDP2's, DDP's forward), and ``other`` the rest of the step
    (Python outside any op: the model's, the autograd engine's, the benchmark loop's).

    Returns:
        category -> microseconds, plus ``allocations``, ``copy_calls``, ``copy_elements`` and
        ``total`` (the step's wall time on the main thread).
    """
    main = collections.Counter(e.thread for e in events if e.name == "breakdown::step").most_common(1)
    thread = main[0][0] if main else None
    out = dict.fromkeys(CATEGORIES, 0.0) | {"allocations": 0, "copy_calls": 0, "copy_elements": 0, "total": 0.0}
    for e in events:
        if e.thread != thread:
            continue
        if e.name == "breakdown::step":
            out["total"] += e.cpu_time_total
            continue
        in_optimizer = _under(e, lambda n: n.startswith("Optimizer.step#") and "Zero" not in n)
        if e.name in _ALLOC_OPS:
            out["allocations"] += 1
        if e.name == "aten::copy_":
            out["copy_calls"] += 1
            shapes = e.input_shapes or []
            if shapes and shapes[0]:
                out["copy_elements"] += math.prod(shapes[0])
        out[_category(e.name, in_optimizer)] += e.self_cpu_time_total
    out["other"] = max(0.0, out["total"] - sum(out[c] for c in CATEGORIES if c != "other"))
    return out


def _category(name: str, in_optimizer: bool) -> str:
    if in_optimizer:
        return "optimizer"
    if name.startswith("c10d::") or name.startswith(_WAIT_PREFIXES) or name.startswith("record_param_comms"):
        return "comm_calls"
    if name.startswith(_HOOK_PREFIXES):
        return "hooks"
    if name in _COPY_OPS:
        return "copies"
    if name.startswith("aten::") or "Backward" in name or name.startswith("autograd::"):
        return "compute"
    return "hooks" if name.startswith("Optimizer.") else "other"


def _under(event: Any, match: Callable[[str], bool]) -> bool:
    node = event
    while node is not None:
        if match(node.name):
            return True
        node = node.cpu_parent
    return False


def _abba(names: list[str], rounds: int) -> list[str]:
    order: list[str] = []
    for _ in range(rounds):
        order += names + names[::-1]
    return order


def _clocked(step: Callable[[], None]) -> tuple[float, float, float]:
    wall, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
    step()
    thread = time.thread_time() - cpu
    return time.perf_counter() - wall, thread, max(0.0, time.process_time() - proc - thread)


def _collective(op: str, n: int) -> Callable[[], Any] | None:
    """One blocking collective of kind ``op`` moving ``n`` float32 elements (``None``: not timed)."""
    world = dist.get_world_size()
    if op == "all_gather":
        small, big = torch.ones(n // world), torch.empty(n)
        return lambda: dist.all_gather_into_tensor(big, small)
    if op == "reduce_scatter":
        big, small = torch.ones(n), torch.empty(n // world)
        return lambda: dist.reduce_scatter_tensor(small, big)
    if op == "all_reduce":
        whole = torch.ones(n)
        return lambda: dist.all_reduce(whole)
    return None


def _comm_wall(by_op: dict[str, int], repeats: int = 3) -> float:
    """Seconds to run this step's collectives (one of each kind, its bytes as float32) alone."""
    world = dist.get_world_size()
    total = 0.0
    for op, nbytes in by_op.items():
        call = _collective(op, max(world, nbytes // 4 // world * world))
        if call is None:
            continue
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        total += statistics.median(samples)
    return total


def run_breakdown(job: BreakdownJob) -> dict[str, Any]:
    """Every rank's entry point.

    Returns:
        name -> ``{"wall", "thread_cpu", "background_cpu"}`` (lists of seconds, one per timed step),
        ``"profile"`` (category -> mean microseconds per step, and counts), ``"bytes"`` (the ledger's
        bytes by op), ``"comm_wall_s"`` and ``"loss"``; and ``"errors"`` for contenders that failed.
    """
    torch.set_num_threads(1)
    paired = job.paired()
    built, errors = {}, {}
    with count_torch_distributed():
        for name in job.contenders:
            try:
                built[name] = CONTENDERS[name](paired)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
        steps = collections.Counter()

        def step(name: str) -> Callable[[], None]:
            def run() -> None:
                contender = built[name]
                contender.zero_grad()
                with torch.profiler.record_function("breakdown::step"):
                    contender.train(batch_for(paired, steps[name]))
                steps[name] += 1
            return run

        names = list(built)
        for name in names * job.warmup:
            step(name)()
        clocks = {name: {"wall": [], "thread_cpu": [], "background_cpu": []} for name in names}
        for name in _abba(names, job.rounds):
            dist.barrier()
            for key, value in zip(("wall", "thread_cpu", "background_cpu"), _clocked(step(name)), strict=True):
                clocks[name][key].append(value)
        profiles: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for name in _abba(names, math.ceil(job.profiled / 2))[: job.profiled * len(names)]:
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                step(name)()
            profiles[name].append(categorise(prof.events()))
        out: dict[str, Any] = {"errors": errors}
        for name in names:
            built[name].zero_grad()
            with ByteLedger() as ledger:
                loss = built[name].train(batch_for(paired, steps[name]))
            by_op = ledger.by_op()
            mean = {key: statistics.fmean(p[key] for p in profiles[name]) for key in profiles[name][0]}
            out[name] = {**clocks[name], "profile": mean, "bytes": by_op, "comm_wall_s": _comm_wall(by_op),
                         "loss": float(loss)}
    return out
