"""Configuration of the async tensor I/O engine.

One frozen, keyword-only dataclass; every field is checked in ``__post_init__`` so a bad block
size or queue depth is refused before a buffer is allocated or a file is opened (DeepSpeed's aio
accepts such values and fails later with an opaque I/O error).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

MIB = 1 << 20
# 4 KiB is the logical block size of NVMe and of ext4/xfs on every machine we target; O_DIRECT
# needs buffer address, length and file offset aligned to it.
DEFAULT_ALIGNMENT = 4096
TRI_STATE = ("auto", "on", "off")


def physical_memory_bytes() -> int:
    """Total RAM of this machine in bytes (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class IOConfig:
    """How the engine moves bytes between tensors and files.

    Attributes:
        block_size: bytes per request a worker hands to the kernel. A multiple of ``alignment``;
            larger blocks mean fewer system calls, smaller ones finer overlap. ``plait io bench``
            finds the best value for a path.
        queue_depth: blocks that may be in flight at once across the engine (submitted to a
            worker or staged in a bounce buffer). Must be >= ``workers`` so no worker idles for
            lack of a buffer. Bounce-buffer memory is at most ``queue_depth * block_size``.
        workers: threads issuing ``pwrite``/``preadv``; the GIL is released during the call, so
            this is the number of requests the kernel sees at once.
        use_o_direct: ``"auto"`` (O_DIRECT where a probe of the directory says it works, buffered
            I/O elsewhere), ``"on"`` (fail if the directory rejects it) or ``"off"``.
        pinned: ``"auto"`` (page-locked bounce buffers when CUDA is available), ``"on"``, ``"off"``.
        fsync: when true a write's handle completes only after ``fdatasync`` of the file, so a
            finished write survives a crash. With O_DIRECT the data already bypasses the page
            cache; ``fdatasync`` still flushes the device cache and the file size.
        alignment: O_DIRECT alignment in bytes (a power of two, at least 512).
        min_free_bytes: space to leave free on the filesystem; a write that would eat into it is
            refused up front with :class:`~plait.offload_io.errors.OffloadDiskFullError`.
    """

    block_size: int = 8 * MIB
    queue_depth: int = 8
    workers: int = 4
    use_o_direct: str = "auto"
    pinned: str = "auto"
    fsync: bool = True
    alignment: int = DEFAULT_ALIGNMENT
    min_free_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        self._check_alignment()
        if not isinstance(self.block_size, int) or self.block_size < self.alignment:
            raise ValueError(
                f"IOConfig.block_size={self.block_size!r} must be an int >= alignment ({self.alignment}); "
                "use e.g. 1 MiB (1048576) to 16 MiB."
            )
        if self.block_size % self.alignment:
            lower = self.block_size // self.alignment * self.alignment
            raise ValueError(
                f"IOConfig.block_size={self.block_size} is not a multiple of alignment={self.alignment}, "
                f"so O_DIRECT requests would be rejected; use {lower} or {lower + self.alignment}."
            )
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 64:
            raise ValueError(f"IOConfig.workers={self.workers!r} must be an int in 1..64; 2-8 suits NVMe.")
        if not isinstance(self.queue_depth, int) or self.queue_depth < self.workers:
            raise ValueError(
                f"IOConfig.queue_depth={self.queue_depth!r} must be an int >= workers={self.workers} "
                f"(each busy worker holds one block); set queue_depth to at least {self.workers}."
            )
        for name in ("use_o_direct", "pinned"):
            value = getattr(self, name)
            if value not in TRI_STATE:
                raise ValueError(f"IOConfig.{name}={value!r} must be one of {', '.join(TRI_STATE)}.")
        if not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0:
            raise ValueError(f"IOConfig.min_free_bytes={self.min_free_bytes!r} must be an int >= 0.")
        self._check_buffer_memory()

    def _check_alignment(self) -> None:
        a = self.alignment
        if not isinstance(a, int) or a < 512 or a & (a - 1):
            raise ValueError(
                f"IOConfig.alignment={a!r} must be a power of two >= 512; use 4096 (the NVMe logical block)."
            )

    def _check_buffer_memory(self) -> None:
        # Bounce buffers are allocated once and reused; more than a quarter of RAM for them is
        # always a typo (a block size in bytes where MiB was meant) and would end in the OOM killer.
        total = self.buffer_bytes
        ram = physical_memory_bytes()
        if ram and total > ram // 4:
            raise ValueError(
                f"IOConfig: queue_depth * block_size = {self.queue_depth} * {self.block_size} = {total} bytes "
                f"of bounce buffers is more than a quarter of this machine's {ram} bytes of RAM; "
                "lower block_size or queue_depth."
            )

    @property
    def buffer_bytes(self) -> int:
        """Bytes of bounce buffers the engine may allocate (``queue_depth * block_size``)."""
        return self.queue_depth * self.block_size


DEVICES = ("cpu", "nvme")
PARAM_DEVICES = ("none", "cpu", "nvme")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where an offloaded optimizer keeps its state and how it steps.

    Attributes:
        device: ``"cpu"`` (optimizer state in CPU memory, ZeRO-Offload) or ``"nvme"`` (in files
            under ``path``, ZeRO-Infinity).
        path: directory for ``device="nvme"``; ignored for ``"cpu"``.
        sub_group_size: most parameter elements stepped as one group. Smaller groups mean less
            memory for the in-flight slots of the NVMe store and finer overlap; larger ones fewer
            I/O requests. With :class:`OffloadedOptimizer` every parameter lands whole in one
            group; the ZeRO placement on NVMe splits a master shard larger than this into
            pieces of at most this many elements, so the store's memory is about
            ``slots x sub_group_size x 12`` bytes for AdamW whatever the largest unit.
        master_weights: ``"auto"`` keeps a separate fp32 CPU copy of a parameter only when the
            parameter is not already fp32 on the CPU; ``"on"`` always does (grads are then copied
            by hooks during backward and parameters copied back after the step); ``"off"`` never
            does and requires fp32 CPU parameters. With ``device="nvme"`` separate masters are
            kept on disk with the optimizer state.
        slots: groups the NVMe store holds in memory at once (3: read next, step current, write
            previous).
        offload_ratio: fraction of each parameter group's elements (whole sub-groups, from the
            front) whose state is offloaded; the remaining sub-groups keep their state and step
            where the parameters are (Twin-Flow: on a GPU the accelerator's step then runs while
            the CPU steps the offloaded part). 1.0 offloads everything.
        io: the I/O engine's settings for ``device="nvme"`` and ``param_device="nvme"``.
        overlap_io: ``device="nvme"``: overlap the store's I/O with forward and backward. The
            first sub-groups' state is read while backward runs (from the first gradient), and
            ``step()`` returns with the last write-backs still in flight; they finish during the
            next forward. A write that fails then is raised by the next ``step()`` (after it
            stepped every sub-group) or by :meth:`flush`; its data stays in memory meanwhile.
            ``False``: each ``step()`` reads everything it needs itself and returns only when all
            state is written (and fsync'd).
        param_device: ZeRO stage 3 only (:func:`~plait.offload_io.zero_placement`): where the
            compute-dtype parameter shards live while no gather needs them (ZeRO-Infinity's
            parameter offload, DeepSpeed's ``offload_param.device``): ``"none"`` (on the compute
            device), ``"cpu"`` (host memory, pinned on CUDA machines) or ``"nvme"`` (files under
            ``path``). Each shard is read back ahead of its gather and written after each step.
        grad_device: ZeRO stages 2/3 with ``device="nvme"``: where reduced gradient shards wait
            for the step. ``"cpu"`` (host memory, 4 bytes per parameter of the rank's shard) or
            ``"nvme"`` (ZeRO-Infinity's gradient offload: each unit's shard is written to a file
            under ``path`` as soon as its reduction is done and freed; the norm reads each back
            once, and the step reads each sub-group's range with its state). Costs three more
            passes of 4 bytes per element of disk traffic per step; saves the gradients' memory.
        memory_budget: the one knob: host memory one rank may use, as bytes (``1 << 30``), a size
            (``"1GiB"``, ``"768MiB"``) or a fraction of the cgroup's limit or the machine's RAM
            (``"0.5"``). Needs ``path``. Every knob left at its default is then chosen from the
            budget (:mod:`plait.offload_io.budget`): ``device``, ``param_device`` -> ``"nvme"``,
            ``sub_group_size``, ``slots``, ``io`` (block size, queue depth, workers), and, once
            ``zero_shard`` sees the model, ``grad_device`` (memory when the gradients fit, else
            disk). A knob set to a non-default value is kept. The choice is logged (logger
            ``plait.offload_io``, INFO) and kept in :attr:`memory_plan`; a budget that cannot fit is
            refused with the smallest one that would (here for the runtime alone, in
            ``zero_shard`` for the model).
    """

    device: str = "cpu"
    path: str | None = None
    sub_group_size: int = 1 << 22
    master_weights: str = "auto"
    slots: int = 3
    offload_ratio: float = 1.0
    io: IOConfig = dataclasses.field(default_factory=IOConfig)
    param_device: str = "none"
    overlap_io: bool = True
    grad_device: str = "cpu"
    memory_budget: int | float | str | None = None
    memory_plan: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    budget_chooses_grad_device: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.memory_budget is not None:
            self._apply_budget()
        if self.device not in DEVICES:
            raise ValueError(f"OffloadConfig.device={self.device!r} must be one of {', '.join(DEVICES)}.")
        if self.device == "nvme" and not self.path:
            raise ValueError("OffloadConfig.device='nvme' needs path= (a directory on the NVMe drive, e.g. "
                             "'/local_nvme/offload').")
        if not isinstance(self.sub_group_size, int) or self.sub_group_size < 1:
            raise ValueError(f"OffloadConfig.sub_group_size={self.sub_group_size!r} must be an int >= 1; "
                             "1e6-1e8 elements is typical (use int(1e8), not 1e8).")
        if self.master_weights not in TRI_STATE:
            raise ValueError(f"OffloadConfig.master_weights={self.master_weights!r} must be one of "
                             f"{', '.join(TRI_STATE)}.")
        if not isinstance(self.slots, int) or self.slots < 2:
            raise ValueError(f"OffloadConfig.slots={self.slots!r} must be an int >= 2; 3 gives double buffering.")
        if not isinstance(self.offload_ratio, (int, float)) or not 0.0 < self.offload_ratio <= 1.0:
            raise ValueError(f"OffloadConfig.offload_ratio={self.offload_ratio!r} must be in (0, 1]; 1.0 offloads "
                             "all optimizer state, 0.7 keeps the last 30% of each group's elements on the device.")
        if self.param_device not in PARAM_DEVICES:
            raise ValueError(f"OffloadConfig.param_device={self.param_device!r} must be one of "
                             f"{', '.join(PARAM_DEVICES)}.")
        if self.param_device == "nvme" and not self.path:
            raise ValueError("OffloadConfig.param_device='nvme' needs path= (a directory on the NVMe drive, e.g. "
                             "'/local_nvme/offload').")
        if self.grad_device not in ("cpu", "nvme"):
            raise ValueError(f"OffloadConfig.grad_device={self.grad_device!r} must be 'cpu' or 'nvme'.")
        if self.grad_device == "nvme" and self.device != "nvme":
            raise ValueError(f"OffloadConfig.grad_device='nvme' needs device='nvme' (got device={self.device!r}): "
                             "gradients go to disk only where the optimizer state does.")
        if not isinstance(self.overlap_io, bool):
            raise ValueError(f"OffloadConfig.overlap_io={self.overlap_io!r} must be True or False.")
        if not isinstance(self.io, IOConfig):
            raise ValueError(f"OffloadConfig.io must be an IOConfig, got {type(self.io).__name__}.")

    def _apply_budget(self) -> None:
        """Fill the knobs left at their defaults from ``memory_budget`` (see the field's doc)."""
        from plait.offload_io.budget import parse_budget, plan_for_budget

        if not self.path:
            raise ValueError(f"OffloadConfig.memory_budget={self.memory_budget!r} needs path= (a directory on the "
                             "NVMe drive, e.g. '/local_nvme/offload'): what does not fit the budget goes there.")
        plan = plan_for_budget(parse_budget(self.memory_budget))
        defaults = {f.name: f.default for f in dataclasses.fields(OffloadConfig) if f.init}
        chosen = {"device": "nvme", "param_device": "nvme", "sub_group_size": plan.sub_group_size,
                  "slots": plan.slots}
        for name, value in chosen.items():
            if getattr(self, name) == defaults[name]:
                object.__setattr__(self, name, value)
        if self.io == IOConfig():
            object.__setattr__(self, "io", IOConfig(block_size=plan.block_size, queue_depth=plan.queue_depth,
                                                    workers=plan.workers))
        # the plan records the knobs in force, explicit ones included: the fit check uses them
        plan = dataclasses.replace(plan, sub_group_size=self.sub_group_size, slots=self.slots,
                                   block_size=self.io.block_size, queue_depth=self.io.queue_depth,
                                   workers=self.io.workers)
        object.__setattr__(self, "memory_plan", plan)
        object.__setattr__(self, "budget_chooses_grad_device", self.grad_device == defaults["grad_device"])
        logging.getLogger("plait.offload_io").info(
            "%s; device=%s, param_device=%s, io=%s", plan.describe(), self.device, self.param_device, self.io)
