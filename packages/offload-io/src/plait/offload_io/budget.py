"""One offload knob: a host-memory budget that sizes the others (``OffloadConfig(memory_budget=...)``).

A budget is bytes (``"1GiB"``, ``"768MiB"``, ``1 << 30``) or a fraction of the memory this process
may use (``"0.5"`` or ``0.5``: of the cgroup's limit, v2 ``memory.max`` or v1
``memory.limit_in_bytes``, else of the machine's RAM). :func:`plan_for_budget` turns it into the
knobs a user would otherwise guess, from this memory model of one rank of ZeRO-3 with parameters,
masters and optimizer state on NVMe (fp32, AdamW), in bytes:

* ``RUNTIME_BYTES``: the interpreter, torch and the libraries (measured 0.24 GiB resident here
  before any model exists; reserved, not chosen);
* the state store's slots: ``slots x sub_group_size x 16`` (fp32 master and two moments, and the
  sub-group's gradient range read with them);
* the I/O engine's bounce buffers: ``queue_depth x block_size``;
* gathered parameters: ``3 x largest unit x 4`` (the unit computing, the one read ahead, and the
  unit's gradient before its reduction);
* gradients kept for the step: ``4 x parameters per rank`` with ``grad_device="cpu"``, nothing
  with ``"nvme"``.

Of what is left after the runtime, an eighth goes to the store's slots and a sixty-fourth to I/O
buffers (clamped to sensible sizes); gradients stay in memory when they fit in the rest beside the
gathered units, else go to disk. :func:`required_bytes` is the same formula, used to refuse a
budget that cannot fit a model before any work and to name the smallest one that would.
Activations are not in the model: they depend on the batch, which the placement never sees.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from typing import Any

from torch import nn

from plait.offload_io.config import IOConfig, physical_memory_bytes

MIB = 1 << 20
RUNTIME_BYTES = 256 * MIB
STATE_BYTES_PER_ELEMENT = 16  # fp32 master + AdamW's two moments + the gradient range
MIN_SUB_GROUP, MAX_SUB_GROUP = 1 << 16, 1 << 26
MIN_BLOCK, MAX_BLOCK = 1 * MIB, 8 * MIB
QUEUE_DEPTH, WORKERS, SLOTS = 4, 2, 3
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def detected_memory_bytes() -> int:
    """The memory this process may use: the tightest limit of its own cgroup and the cgroups above
    it (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, found through ``/proc/self/cgroup``) when
    one is set, else the machine's RAM (0 when nothing says)."""
    ram = physical_memory_bytes()
    limits = [limit for path in _cgroup_limit_files() if (limit := _read_limit(path)) is not None]
    # "max" (v2) or a huge number (v1) means no limit: the machine's RAM then
    bounded = [limit for limit in limits if not ram or limit < ram]
    return min(bounded) if bounded else ram


def _cgroup_limit_files() -> list[str]:
    """The memory limit files of this process's cgroup and its ancestors, own first. A process in
    a child cgroup (a container's job, the capacity benchmark's worker) is limited by its own
    group, not only by the root's file that a container usually shows at the mount point."""
    files = []
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            root, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            root, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            files.append(os.path.join(root, *parts[:depth], name))
    return files + ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def parse_budget(value: int | float | str) -> int:
    """Bytes of a budget given as bytes, a size with a unit, or a fraction of the detected memory.

    Raises:
        ValueError: naming ``OffloadConfig.memory_budget``, the value and the accepted forms.
    """
    forms = "bytes (1073741824), a size ('1GiB', '768MiB', '2GB') or a fraction of this process's memory ('0.5')"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"OffloadConfig.memory_budget={value!r}: use {forms}.")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"OffloadConfig.memory_budget={value!r}: use {forms}.")
        number, unit = float(match.group(1)), match.group(2).lower()
        value = number if not unit and number <= 1 else int(number * _UNITS[unit])
    if isinstance(value, float) and 0 < value <= 1:
        total = detected_memory_bytes()
        if not total:
            raise ValueError(f"OffloadConfig.memory_budget={value!r}: this platform does not say how much memory "
                             "there is; give bytes instead ('1GiB').")
        return int(value * total)
    if value < 1 or value != int(value):
        raise ValueError(f"OffloadConfig.memory_budget={value!r}: use {forms}.")
    return int(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What a budget chose. Attributes: ``budget`` (bytes), ``sub_group_size``, ``slots``,
    ``block_size`` and ``queue_depth`` (the I/O engine's), ``workers``."""

    budget: int
    sub_group_size: int
    slots: int
    block_size: int
    queue_depth: int
    workers: int

    @property
    def fixed_bytes(self) -> int:
        """Runtime, store slots and I/O buffers: the part that does not depend on the model."""
        return RUNTIME_BYTES + self.slots * self.sub_group_size * STATE_BYTES_PER_ELEMENT + \
            self.queue_depth * self.block_size

    def describe(self) -> str:
        """One line for the log: the budget and every knob it set."""
        return (f"memory_budget {self.budget / MIB:.0f} MiB: sub_group_size={self.sub_group_size}, slots={self.slots}, "
                f"io block_size={self.block_size // MIB} MiB x queue_depth={self.queue_depth}, "
                f"workers={self.workers} (fixed part {self.fixed_bytes / MIB:.0f} MiB)")


def plan_for_budget(budget: int) -> MemoryPlan:
    """The knobs for ``budget`` bytes (see the module docstring).

    Raises:
        ValueError: the budget does not even hold the runtime, the smallest store and I/O
            buffers; names the smallest budget that would.
    """
    smallest = MemoryPlan(budget=budget, sub_group_size=MIN_SUB_GROUP, slots=SLOTS, block_size=MIN_BLOCK,
                          queue_depth=QUEUE_DEPTH, workers=WORKERS)
    if budget < smallest.fixed_bytes:
        raise ValueError(f"OffloadConfig.memory_budget={budget} bytes cannot hold the runtime ({RUNTIME_BYTES // MIB} "
                         f"MiB), the state store and the I/O buffers; the smallest budget is "
                         f"{_mib_up(smallest.fixed_bytes)} MiB before any model: raise memory_budget.")
    spare = budget - RUNTIME_BYTES
    sub_group = _clamp(spare // 8 // (SLOTS * STATE_BYTES_PER_ELEMENT), MIN_SUB_GROUP, MAX_SUB_GROUP)
    block = _clamp(1 << int(math.log2(max(spare // 64 // QUEUE_DEPTH, 1))), MIN_BLOCK, MAX_BLOCK)
    return MemoryPlan(budget=budget, sub_group_size=int(sub_group), slots=SLOTS, block_size=int(block),
                      queue_depth=QUEUE_DEPTH, workers=WORKERS)


def required_bytes(plan: MemoryPlan, *, rank_numel: int, largest_unit_numel: int, grads_in_memory: bool) -> int:
    """Host bytes one rank needs under ``plan`` (the module docstring's formula).

    Args:
        plan: the chosen knobs.
        rank_numel: parameters this rank holds a shard of (the model's over the world size).
        largest_unit_numel: elements of the largest unit gathered at once (a block, the embedding).
        grads_in_memory: ``grad_device="cpu"``.
    """
    return plan.fixed_bytes + 3 * largest_unit_numel * 4 + (4 * rank_numel if grads_in_memory else 0)


def smallest_budget(*, rank_numel: int, largest_unit_numel: int) -> int:
    """The smallest budget that fits a model (gradients on disk, the smallest store and buffers),
    rounded up to a MiB."""
    smallest = MemoryPlan(budget=0, sub_group_size=MIN_SUB_GROUP, slots=SLOTS, block_size=MIN_BLOCK,
                          queue_depth=QUEUE_DEPTH, workers=WORKERS)
    need = required_bytes(smallest, rank_numel=rank_numel, largest_unit_numel=largest_unit_numel,
                          grads_in_memory=False)
    return _mib_up(need) * MIB


def largest_unit_numel(model: nn.Module) -> int:
    """Elements of the largest module ZeRO-3 with offloaded parameters gathers at once: a module
    holding no ``nn.ModuleList`` (a block, the embedding, the head), counted with its children."""
    best = 0
    for module in model.modules():
        if module is model or isinstance(module, nn.ModuleList):
            continue
        if any(isinstance(m, nn.ModuleList) for m in module.modules()):
            continue  # a container of the blocks (HF's ``model.model``): its own leaves are counted
        best = max(best, sum(p.numel() for p in module.parameters()))
    return best or sum(p.numel() for p in model.parameters())


def fit_model(config: Any, model: nn.Module, world_size: int) -> Any:
    """Check ``config``'s budget against ``model`` sharded over ``world_size`` ranks, before any
    work: shrink the store and I/O buffers the budget chose when the model needs the room, put
    gradients in memory when they fit (else on disk) unless ``grad_device`` was set, and log it.

    Args:
        config: an ``OffloadConfig`` with ``memory_budget``.
        model: the model (meta or constructed parameters are fine: only shapes are read).
        world_size: ranks the parameters are sharded over.

    Returns:
        The ``OffloadConfig`` to use.

    Raises:
        ValueError: the budget cannot hold the model; names the smallest budget that would.
    """
    plan = config.memory_plan
    numel = sum(p.numel() for p in model.parameters())
    rank_numel, largest = -(-numel // world_size), largest_unit_numel(model)
    need = required_bytes(plan, rank_numel=rank_numel, largest_unit_numel=largest, grads_in_memory=False)
    least = smallest_budget(rank_numel=rank_numel, largest_unit_numel=largest)
    choose_grads = config.budget_chooses_grad_device
    chosen_io = IOConfig(block_size=plan.block_size, queue_depth=plan.queue_depth, workers=plan.workers)
    if need > plan.budget >= least and config.io == chosen_io:
        # the budget's own store and buffers are too large beside this model: the smallest ones
        smallest_io = IOConfig(block_size=MIN_BLOCK, queue_depth=plan.queue_depth, workers=plan.workers)
        config = dataclasses.replace(config, sub_group_size=MIN_SUB_GROUP, io=smallest_io)
        plan = config.memory_plan
        need = required_bytes(plan, rank_numel=rank_numel, largest_unit_numel=largest, grads_in_memory=False)
    if need > plan.budget:
        raise ValueError(
            f"OffloadConfig.memory_budget={config.memory_budget!r} ({plan.budget >> 20} MiB) cannot train this model: "
            f"{numel} parameters over {world_size} rank(s), largest unit {largest} elements, need {need >> 20} MiB "
            f"with these settings; the smallest budget that fits is {least >> 20} MiB: raise memory_budget or shard "
            "over more ranks.")
    if choose_grads:
        in_memory = required_bytes(plan, rank_numel=rank_numel, largest_unit_numel=largest, grads_in_memory=True)
        grad_device = "cpu" if in_memory <= plan.budget else "nvme"
        config = dataclasses.replace(config, grad_device=grad_device)
        need = in_memory if grad_device == "cpu" else need
    logging.getLogger("plait.offload_io").info(
        "memory_budget %d MiB for %d parameters (largest unit %d): grad_device=%s, about %d MiB needed",
        plan.budget >> 20, numel, largest, config.grad_device, need >> 20)
    return config


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _mib_up(nbytes: int) -> int:
    return -(-nbytes // MIB)


__all__ = ["MemoryPlan", "detected_memory_bytes", "fit_model", "largest_unit_numel", "parse_budget", "plan_for_budget",
           "required_bytes", "smallest_budget"]
