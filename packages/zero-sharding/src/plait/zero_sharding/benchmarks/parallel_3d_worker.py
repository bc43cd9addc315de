"""One rank of ``plait bench parallel-3d``: plait ZeRO-2 and FSDP2 on one (dp, pp, tp) mesh, trained
step for step in alternating order, with one step's bytes counted per mesh dimension.

Both contenders get the same decoder stage (the BLOOM-shaped decoder of :mod:`.parallel_3d_model`),
the same TP plan on ``tp`` and torch's GPipe schedule on ``pp``; plait shards the stage over ``dp``
with ``zero_shard(..., ZeroConfig(stage=2))`` and runs it in a
:class:`~plait.zero_sharding.pipelining.ZeroPipelineStage`, FSDP2 with ``fully_shard`` per block and
on the stage (``reshard_after_forward=False``: ZeRO-2's memory) in torch's ``PipelineStage``.

Every layout trains the same objective: the mean cross-entropy of the global batch (each rank's
microbatch losses scaled by ``dp x microbatch rows / global rows``, so the average over ``dp`` of
the microbatch sums is the global mean), which one process computes directly.

Bytes of one step (the ``count_step``-th), per mesh dimension:

* ``dp``: plait's collectives, from the :class:`~plait.kernels.collectives.ByteLedger`;
* ``tp``: torch's functional collectives that DTensor issues (a dispatch mode counts each one's
  input bytes);
* ``pp``: the activations and gradients torch's schedule sends (its batched point-to-point calls,
  counted by wrapping them for the step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from plait.kernels.collectives import ByteLedger
from plait.zero_sharding.benchmarks import parallel_3d_model as m

CONTENDERS = ("plait ZeRO-2", "FSDP2")
_FUNCTIONAL = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}


class FunctionalBytes(TorchDispatchMode):
    """Counts the input bytes of torch's functional collectives (what DTensor issues)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "_c10d_functional" and func._opname in _FUNCTIONAL:
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def pipeline_send_bytes(box: dict) -> Iterator[None]:
    """Adds to ``box["bytes"]`` the tensor bytes of every send torch's pipeline schedules issue."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def counted(ops: list, desc: str | None = None) -> list:
        box["bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops, desc=desc)

    with mock.patch.object(schedules, "_batch_p2p", counted):
        yield


def _mesh(dims: dict[str, int]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))


class Contender:
    """One contender's stage, optimizer and schedule on this rank."""

    def __init__(self, name: str, mesh: Any, dims: dict[str, int], spec: dict[str, Any]) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        from plait.zero_sharding import ZeroConfig, zero_shard
        from plait.zero_sharding.pipelining import ZeroPipelineStage

        shape, self.spec, self.name = m.DecoderShape(**spec["shape"]), spec, name
        self.dp = mesh["dp"].get_group()
        self.dp_size = dims["dp"]
        self.pp_size = dims.get("pp", 1)
        self.pp_rank = mesh["pp"].get_local_rank() if "pp" in dims else 0
        self.tp_size = dims.get("tp", 1)
        stage = m.build_stage(shape, self.pp_rank, self.pp_size)
        self.replicated, self.split = m.tp_split_numel(stage)
        self.layers = len(stage.blocks)
        if "tp" in dims:
            m.tensor_parallel(stage, mesh["tp"])
        if name == "FSDP2":
            from torch.distributed.fsdp import fully_shard

            for block in stage.blocks:
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
            self.module, self.optimizer = stage, torch.optim.AdamW(stage.parameters(), **spec["adamw"])
        else:
            self.module, self.optimizer = zero_shard(stage, torch.optim.AdamW, ZeroConfig(stage=2), mesh=mesh["dp"],
                                                     **spec["adamw"])
        self.rows = spec["rows"] // self.dp_size
        self.scale = self.dp_size * spec["micro_rows"] / spec["rows"]
        self.schedule = None
        if self.pp_size > 1:
            stage_cls = PipelineStage if name == "FSDP2" else ZeroPipelineStage
            pipe = stage_cls(self.module, self.pp_rank, self.pp_size, torch.device("cpu"),
                             group=mesh["pp"].get_group())
            self.schedule = ScheduleGPipe(pipe, n_microbatches=self.rows // spec["micro_rows"], loss_fn=self.loss)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A microbatch's scaled loss (see the module docstring)."""
        return self.scale * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def step(self, ids: torch.Tensor, target: torch.Tensor, state: dict | None = None) -> float:
        """One training step on this rank's rows; returns the global objective (last stage; 0 elsewhere).
        With ``state``, records the model-state bytes after backward (plait only)."""
        parts: list[torch.Tensor] = []
        if self.schedule is None:
            loss = F.cross_entropy(self.module(ids).reshape(-1, self.spec["shape"]["vocab"]), target.reshape(-1))
            loss.backward()
            parts.append(loss.detach())  # the mean of this rank's rows: averaged over dp below
        elif self.pp_rank == 0:
            self.schedule.step(ids)
        else:
            self.schedule.step(target=target, losses=parts)
        if state is not None and self.name != "FSDP2":
            from plait.zero_sharding import model_state_bytes

            state["measured"] = model_state_bytes(self.module)["total"]
        self.optimizer.step()
        self.optimizer.zero_grad()
        total = torch.stack(parts).detach().sum().reshape(1) if parts else torch.zeros(1)
        dist.all_reduce(total, group=self.dp)
        return float(total) / self.dp_size

    def formulas(self) -> dict[str, int]:
        """One step's bytes per mesh dimension and the model-state bytes, from the 3-D formula."""
        shape = m.DecoderShape(**self.spec["shape"])
        local = self.replicated + self.split // self.tp_size  # this rank's TP shard of its stage
        units = self.module.zero_engine.units
        assert sum(u.numel for u in units) == local, (sum(u.numel for u in units), local)
        shard = [-(-u.numel // self.dp_size) for u in units]  # ZeRO pads each unit to a multiple of dp
        activation = self.rows * shape.seq * shape.hidden * 4  # fp32 hidden states of this rank's rows
        return {
            # ZeRO-2: each unit's gradients reduce-scattered once per step, its parameters all-gathered after the step
            "dp": sum(2 * 4 * self.dp_size * s for s in shard),
            # Megatron: per block and row, 2 all-reduces in forward (dense, mlp.down) and 2 in backward (the
            # inputs' gradients of query_key_value and mlp.up)
            "tp": 4 * self.layers * activation if self.tp_size > 1 else 0,
            # each stage sends its output forward (all but the last) and its input's gradient back (all but the first)
            "pp": ((self.pp_rank < self.pp_size - 1) + (self.pp_rank > 0)) * activation,
            # fp32 AdamW under ZeRO-2: whole parameters (4 bytes), gradient shard (4), exp_avg and exp_avg_sq
            # shards (8), one fp32 step counter per unit
            "state": sum(4 * self.dp_size * s + 12 * s + 4 for s in shard),
        }


def data(spec: dict[str, Any], step: int, dp_rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's rows of step ``step``'s global batch (token ids and next-token targets)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, spec["shape"]["vocab"], (spec["rows"], spec["shape"]["seq"] + 1), generator=gen)
    mine = tokens[dp_rank * rows:(dp_rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def run_layout(dims: dict[str, int], spec: dict[str, Any]) -> dict[str, Any]:
    """Every rank: both contenders trained ``spec["steps"]`` steps in A B B A order, timed between
    barriers after the warm-up; one step's bytes counted for plait."""
    torch.set_num_threads(1)
    mesh = _mesh(dims)
    contenders = {name: Contender(name, mesh, dims, spec) for name in CONTENDERS}
    dp_rank = mesh["dp"].get_local_rank()
    losses: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    counted: dict[str, int] = {}
    for step in range(spec["steps"]):
        for name in (CONTENDERS if step % 2 == 0 else CONTENDERS[::-1]):
            contender = contenders[name]
            ids, target = data(spec, step, dp_rank, contender.rows)
            count = step == spec["count_step"] and name != "FSDP2"
            ledger, functional, sends, state = ByteLedger(), FunctionalBytes(), {"bytes": 0}, {}
            dist.barrier()
            start = time.perf_counter()
            with contextlib.ExitStack() as stack:
                if count:
                    stack.enter_context(ledger)
                    stack.enter_context(functional)
                    stack.enter_context(pipeline_send_bytes(sends))
                losses[name].append(contender.step(ids, target, state if count else None))
            dist.barrier()
            if step >= spec["warmup"]:
                times[name].append(time.perf_counter() - start)
            if count:
                on_dp = ledger.total(group=_group_name(contender.dp))
                counted = {"dp": on_dp, "tp": functional.bytes, "pp": sends["bytes"],
                           "other": ledger.total() - on_dp, "state": state["measured"]}
    ours = contenders[CONTENDERS[0]]
    return {"losses": losses, "times": times, "counted": counted, "formula": ours.formulas(),
            "rank": dist.get_rank(), "pp_rank": ours.pp_rank}


def _group_name(group: Any) -> str:
    """The ledger's name of a process group (its global ranks)."""
    return "ranks[" + ",".join(map(str, dist.get_process_group_ranks(group))) + "]"
