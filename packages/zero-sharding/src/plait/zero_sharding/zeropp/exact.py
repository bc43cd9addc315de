"""Exact two-hop gradient reduction across nodes: reduce-scatter inside the node, then across.

What crosses the slow link is set by the collective's algorithm, not by the formula. Measured on
two emulated nodes of two ranks (``plait bench zero-sharding-nodes``; S = the bucket's bytes),
gloo's ``reduce_scatter_tensor`` moves 3 S between the nodes (it runs an all-reduce and keeps a
slice), a ring would move 1.5 S, and this two-hop form 1 S. ZeRO++ without qgZ (hpZ alone) uses
it whenever the launcher's layout spans nodes, so that with the backward gather kept in the node
the gradient reduction is not what fills the link.

With ``L`` ranks per node and ``N`` nodes (group rank ``g = n * L + l``) and ``c`` elements per
rank's shard:

1. Inside the node, a reduce-scatter of the bucket reordered so that local rank ``l`` receives
   the node's sums of the ``N`` shards ``m * L + l`` (``m = 0..N-1``): ``W x c`` elements in,
   ``N x c`` out. It runs as an all-to-all (local rank ``l`` receives every node peer's copy of
   those shards) and a sum in local-rank order, which lets hop 2 start as soon as it arrives
   (see :class:`~plait.zero_sharding.zeropp.wire.TwoHopComm`).
2. Across nodes, among the ``N`` ranks with local index ``l``, an all-to-all of those ``N`` node
   sums: shard ``m * L + l`` goes to node ``m``. Each rank adds the ``N`` node sums of its own
   shard.

Bytes leaving a node per rank: ``(N - 1) x c x itemsize`` (hop 2 only), against gloo's
all-reduce-based reduce-scatter's ``~2 x (W - 1) / W x W x c``. The result is the exact sum,
only added in another order than the one-hop collective's (fp32 rounding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plait.kernels import collectives
from plait.zero_sharding.extension import DefaultReducer
from plait.zero_sharding.zeropp.nodes import is_group, node_subgroups
from plait.zero_sharding.zeropp.wire import TwoHopComm, TwoHopQueue


class HierarchicalReducer(DefaultReducer):
    """A :class:`~plait.zero_sharding.extension.GradientReducer` reducing in two exact hops across nodes.

    Build it on every rank of ``group`` at the same point (it creates the node subgroups, a
    collective). Reductions over any other group (HSDP's replica group) and all-reduces take
    the engine's one-hop default.

    Args:
        node_size: ranks per node, consecutive in ``group``; a divisor of its size, more than 1
            and less than the group size (otherwise the one-hop default is the same thing).
        group: the sharding group (``None``: the world).

    Raises:
        ValueError: ``node_size`` is not a divisor of the group size strictly between 1 and it,
            or torch.distributed is not initialised.
    """

    def __init__(self, *, node_size: int, group: Any | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError("HierarchicalReducer needs torch.distributed initialised (it creates node subgroups); "
                             "call torch.distributed.init_process_group first.")
        world = dist.get_world_size(group)
        if isinstance(node_size, bool) or not isinstance(node_size, int) or not 1 < node_size < world \
                or world % node_size:
            raise ValueError(f"HierarchicalReducer: node_size={node_size!r} must divide the group size {world} and lie "
                             f"strictly between 1 and {world}; with one node use the default reducer.")
        self.node_size, self.group, self.nodes = node_size, group, world // node_size
        self.ranks, self.intra, self.inter = node_subgroups(group, node_size)
        self._queue = TwoHopQueue()  # launched reductions whose hop 2 has not started

    def _is_own_group(self, group: Any) -> bool:
        return is_group(group, self.group, self.ranks)

    def reduce_scatter(self, full: Tensor, shard_out: Tensor, *, group: Any, key: str) -> Any:
        """Write into ``shard_out`` the sum over the group of this rank's shard of ``full``, in two hops.

        Args:
            full: flat bucket of ``world * shard`` elements; rank ``r``'s shard is
                ``full[r * shard:(r + 1) * shard]``. Not modified.
            shard_out: ``shard`` elements of ``full``'s dtype.
            group: the process group; another than this reducer's takes the one-hop default.
            key: the bucket's stable id (names the collectives).

        Returns:
            A handle whose ``wait()`` completes ``shard_out``: hop 1 runs asynchronously; hop 2
            (which needs hop 1's sums) starts at this reducer's next launch that finds hop 1
            arrived, else inside ``wait()``. Second hops are issued in launch order on every rank,
            whatever order the handles are waited in
            (:class:`~plait.zero_sharding.zeropp.wire.TwoHopQueue`).

        Raises:
            ValueError: ``full`` is not ``world`` times ``shard_out``'s size.
        """
        if not self._is_own_group(group):
            return super().reduce_scatter(full, shard_out, group=group, key=key)
        shard, nodes, size = shard_out.numel(), self.nodes, self.node_size
        if full.numel() != nodes * size * shard:
            raise ValueError(f"HierarchicalReducer.reduce_scatter: full has {full.numel()} elements, not world x shard "
                             f"= {nodes * size} x {shard}.")
        # Hop 1 as an all-to-all plus a local sum, not gloo's reduce-scatter: that one runs an
        # all-reduce inside (more bytes) and its handle never reports completion before wait(),
        # so hop 2 could not start early. Peer l' gets, in node order, the shards of ranks (m, l').
        ordered = full.view(nodes, size, shard).transpose(0, 1).contiguous()
        received = torch.empty_like(ordered)
        work = collectives.all_to_all_single(received, ordered, group=self.intra, async_op=True,
                                             name=f"two-hop reduce-scatter inside the node of `{key}`")

        def across_nodes() -> tuple[Any, Any]:
            node_sums = received.sum(dim=0)  # [nodes, shard]: this node's sums, in local-rank order
            inbound = torch.empty_like(node_sums)
            hop2 = collectives.all_to_all_single(inbound, node_sums, group=self.inter, async_op=True,
                                                 name=f"two-hop reduce-scatter across nodes of `{key}`")
            return hop2, lambda: torch.sum(inbound, dim=0, out=shard_out)

        handle = TwoHopComm(self._queue, work, across_nodes)
        self._queue.progress()  # earlier buckets whose hop 1 has arrived send their hop 2 now
        return handle
