"""Collectives with byte accounting and names: thin ``torch.distributed`` wrappers and the ledger.

Every plait package communicates through these functions so that one :class:`ByteLedger`
sees every byte; :func:`count_torch_distributed` and :func:`count_ddp` count peers the same way.
Every call is also entered in this rank's flight log under a plait-level name (``name=`` or a
:func:`named` block, plus :func:`set_step`), so a collective that fails because a rank never
entered it raises a :class:`CollectiveError` naming that rank, the collective and what the rank
last did; :func:`wait_summary` names the rank the others wait on; :class:`PreemptionGuard` stops every
rank after the same step when any of them is sent SIGTERM; :func:`init_process_group` joins a
group that survives ``torchrun --max-restarts``.
"""

from plait.kernels.collectives.compressed import (
    compressed_allreduce,
    compressed_allreduce_nbytes,
    compressed_allreduce_reference,
    compressed_numel,
)
from plait.kernels.collectives.flight import (
    CollectiveEvent,
    clear_history,
    history,
    named,
    set_step,
    wait_seconds,
)
from plait.kernels.collectives.hangs import CollectiveError, ensure_publisher, group_timeout
from plait.kernels.collectives.ledger import ByteLedger, CommRecord, group_name, tensor_nbytes
from plait.kernels.collectives.ops import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    irecv,
    isend,
    recv,
    reduce_scatter_tensor,
    send,
)
from plait.kernels.collectives.peers import count_ddp, count_torch_distributed
from plait.kernels.collectives.preemption import PreemptionGuard, any_rank
from plait.kernels.collectives.restarts import init_process_group, restart_count
from plait.kernels.collectives.rows_op import all_to_all_rows
from plait.kernels.collectives.stragglers import WaitSummary, wait_summary

__all__ = [
    "ByteLedger", "CollectiveError", "CollectiveEvent", "CommRecord", "PreemptionGuard", "WaitSummary",
    "any_rank", "clear_history", "init_process_group", "restart_count",
    "ensure_publisher", "group_timeout",
    "history", "named", "set_step", "wait_seconds", "wait_summary",
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce",
    "all_to_all_rows", "all_to_all_single", "barrier", "broadcast", "compressed_allreduce",
    "compressed_allreduce_nbytes",
    "compressed_allreduce_reference", "compressed_numel", "count_ddp", "count_torch_distributed", "group_name",
    "irecv", "isend", "recv", "reduce_scatter_tensor", "send", "tensor_nbytes",
]
