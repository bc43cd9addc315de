"""Counting the collectives a peer issues (DDP, FSDP2, DeepSpeed) with the same ledger.

Peers do not call plait's wrappers, so they are counted from outside:

* :func:`count_torch_distributed` swaps the public ``torch.distributed`` collective functions for
  counting versions for the duration of a ``with`` block. FSDP2 and DeepSpeed call these
  functions through the module attribute, so every call they make is seen.
* DDP's reducer calls the process group from C++, past those functions. :func:`count_ddp`
  registers a communication hook on the DDP module that records each gradient bucket and then
  runs the same all-reduce DDP would have run (sum, then divide by the world size).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.collectives.ledger import record, tensor_nbytes

# Bound at import, before count_torch_distributed() can swap the module attribute, so the DDP
# hook's own all-reduce is recorded once (by the hook) even inside that block.
_torch_all_reduce = dist.all_reduce


def _size_all_gather_into_tensor(args: tuple, kwargs: dict) -> tuple[int, torch.dtype]:
    output = kwargs.get("output_tensor", args[0] if args else None)
    return tensor_nbytes(output), output.dtype


def _size_all_gather(args: tuple, kwargs: dict) -> tuple[int, torch.dtype]:
    tensor_list = kwargs.get("tensor_list", args[0] if args else None)
    return sum(tensor_nbytes(t) for t in tensor_list), tensor_list[0].dtype


def _size_second_tensor(args: tuple, kwargs: dict) -> tuple[int, torch.dtype]:
    tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
    return tensor_nbytes(tensor), tensor.dtype


def _size_first_tensor(args: tuple, kwargs: dict) -> tuple[int, torch.dtype]:
    tensor = kwargs.get("tensor", args[0] if args else None)
    return tensor_nbytes(tensor), tensor.dtype


def _size_reduce_scatter_list(args: tuple, kwargs: dict) -> tuple[int, torch.dtype]:
    input_list = kwargs.get("input_list", args[1] if len(args) > 1 else None)
    return sum(tensor_nbytes(t) for t in input_list), input_list[0].dtype


def _size_all_to_all_list(args: tuple, kwargs: dict) -> tuple[int, torch.dtype]:
    input_list = kwargs.get("input_tensor_list", args[1] if len(args) > 1 else None)
    return sum(tensor_nbytes(t) for t in input_list), input_list[0].dtype


# torch.distributed function -> (ledger op name, how to size its logical tensor)
_COUNTED: dict[str, tuple[str, Callable[[tuple, dict], tuple[int, torch.dtype]]]] = {
    "all_gather_into_tensor": ("all_gather", _size_all_gather_into_tensor),
    "all_gather_single": ("all_gather", _size_all_gather_into_tensor),
    "reduce_scatter_single": ("reduce_scatter", _size_second_tensor),
    "_all_gather_base": ("all_gather", _size_all_gather_into_tensor),
    "all_gather": ("all_gather", _size_all_gather),
    "reduce_scatter_tensor": ("reduce_scatter", _size_second_tensor),
    "_reduce_scatter_base": ("reduce_scatter", _size_second_tensor),
    "reduce_scatter": ("reduce_scatter", _size_reduce_scatter_list),
    "all_reduce": ("all_reduce", _size_first_tensor),
    "reduce": ("reduce", _size_first_tensor),
    "all_to_all_single": ("all_to_all", _size_second_tensor),
    "all_to_all": ("all_to_all", _size_all_to_all_list),
    "broadcast": ("broadcast", _size_first_tensor),
    "send": ("send", _size_first_tensor),
    "isend": ("send", _size_first_tensor),
    "recv": ("recv", _size_first_tensor),
    "irecv": ("recv", _size_first_tensor),
}


def _counting(name: str, fn: Callable, op: str, sizer: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nbytes, dtype = sizer(args, kwargs)
        record(op, kwargs.get("group"), nbytes, dtype, source="torch.distributed")
        return fn(*args, **kwargs)

    wrapper.__plait_counting__ = name  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def count_torch_distributed() -> Iterator[None]:
    """Count every public ``torch.distributed`` collective call made inside the block.

    Use together with a :class:`ByteLedger`; records carry ``source="torch.distributed"``.
    The originals are restored on exit, even on error. Calls plait makes through its own
    wrappers are recorded once, by the wrapper (source ``"plait"``): the wrappers bound torch's
    originals at import, so they never pass through these counting versions.
    """
    saved: dict[str, Callable] = {}
    try:
        for name, (op, sizer) in _COUNTED.items():
            fn = getattr(dist, name, None)
            if fn is None or hasattr(fn, "__plait_counting__"):
                continue
            saved[name] = fn
            setattr(dist, name, _counting(name, fn, op, sizer))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def count_ddp(ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Make a DDP module record each gradient-bucket all-reduce in the active ledgers.

    The hook does exactly what DDP's default does (all-reduce the bucket, divide by the world
    size), so training is unchanged; it must be registered before the first backward.
    """
    group = ddp_model.process_group

    # DDP checks the hook's annotations as real objects; with postponed annotations they would
    # be strings, so the hook is annotated explicitly below.
    def hook(state, bucket):
        buffer = bucket.buffer()
        record("all_reduce", group, tensor_nbytes(buffer), buffer.dtype, source="torch.distributed")
        buffer.div_(dist.get_world_size(group))
        work = _torch_all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    ddp_model.register_comm_hook(None, hook)
