"""Collectives with byte accounting: thin ``torch.distributed`` wrappers and the ledger.

Every plait package communicates through these functions so that one :class:`ByteLedger`
sees every byte; :func:`count_torch_distributed` and :func:`count_ddp` count peers the same way.
"""

from plait.kernels.collectives.compressed import (
    compressed_allreduce,
    compressed_allreduce_nbytes,
    compressed_allreduce_reference,
    compressed_numel,
)
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

__all__ = [
    "ByteLedger", "CommRecord", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce",
    "all_to_all_single", "barrier", "broadcast", "compressed_allreduce", "compressed_allreduce_nbytes",
    "compressed_allreduce_reference", "compressed_numel", "count_ddp", "count_torch_distributed", "group_name",
    "irecv", "isend", "recv", "reduce_scatter_tensor", "send", "tensor_nbytes",
]
