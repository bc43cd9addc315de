"""ZeRO++ quantized gradient reduction (qgZ): quantize, all-to-all, dequantize and sum in fp32.

A ring reduce-scatter adds partial sums hop by hop, so quantizing it would quantize (and lose
precision) once per hop. qgZ instead quantizes each gradient once: every rank cuts its bucket
into one slice per destination rank, quantizes each slice on its own (int4 by default, or int8),
and one all-to-all delivers to every rank the quantized copies of its own slice from all
ranks. The receiver dequantizes them and sums in fp32, so the reduction itself adds no error
beyond the one quantization of each input.

Flat (one node, or ``node_size`` None / 1 / the group size): that single all-to-all over the
group is the whole algorithm.

Hierarchical (``node_size = L`` ranks per node, ``N = W / L`` nodes, the ranks of a node
consecutive in the group; group rank ``g = n * L + l`` is local rank ``l`` of node ``n``), as
the ZeRO++ paper and DeepSpeed do it, so the slow inter-node link carries reduced data:

1. Intra-node all-to-all. Rank ``(n, l)`` sends to node peer ``l'`` the ``N`` slices
   ``m * L + l'`` (``m = 0..N-1``): the slices that ``l'`` and its counterparts on the other
   nodes own. Each slice is quantized on its own. The receiver dequantizes the ``L`` copies
   of each of its ``N`` slices and sums them in fp32: node ``n``'s partial sums of the slices
   owned by local rank ``l`` on every node.
2. Inter-node all-to-all among the ``N`` ranks with the same local index ``l``. Rank
   ``(n, l)`` re-quantizes the partial sum of slice ``m * L + l`` and sends it to node ``m``;
   it receives every node's partial sum of its own slice ``g``, dequantizes and sums in fp32.

Logical bytes (the ledger's all-to-all input, own slice included) with ``P`` the payload of
one slice, ``P = code bytes + 4 x ceil(shard / block_size)`` and ``shard = Psi / W``:

* flat: ``W x P`` on the group (``Psi x (bits / 8 + 4 / block_size)``), of which
  ``(W - L) x P`` leave the node;
* hierarchical: ``W x P`` inside the node (hop 1) plus ``N x P = W x P / L`` across nodes
  (hop 2), of which ``(N - 1) x P`` leave the node: the inter-node link carries ``1 / L`` of
  the flat version's bytes, logical and on the wire.

Error bound, per element of rank ``g``'s result with ``q = 7`` (int4) or ``127`` (int8) and
``h(v) = max|v| over v's block / (2q)`` (half a quantization step):

* flat: ``|err| <= sum over ranks i of h(x_i)`` (each input quantized once);
* hierarchical: ``|err| <= sum_i h(x_i) + sum over nodes m of h(P'_m)``, where ``P'_m`` is
  node ``m``'s dequantized partial sum; since ``max|P'_m| <= max|P_m| + e1_m`` (``P_m`` the
  exact node sum, ``e1_m`` its hop-1 error), the second term is at most
  ``sum_m (max|P_m| + max e1_m) / (2q)``: each value is quantized twice, and the bound about
  doubles (the node sum's block max is at most the sum of its inputs' block maxes).

Overlap: hop 1 runs asynchronously from :meth:`QuantizedGradientReducer.reduce_scatter`. Hop 2
needs hop 1's sums, so it starts at the reducer's next launch that finds hop 1 arrived (summing
the node's rows then, asynchronously sending them across) or, at the latest, in the handle's
``wait()``. Under the engine (two reductions in flight, waited in order) the cross-node hop of one
bucket thus travels during the backward of the next units rather than inside the wait. Second
hops are issued in launch order on every rank whatever the order of waits
(:class:`~plait.zero_sharding.zeropp.wire.TwoHopQueue`): gloo pairs a group's collectives by order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plait.kernels import collectives
from plait.zero_sharding.zeropp.gather import DEFAULT_BLOCK_SIZE, _check_format
from plait.zero_sharding.zeropp.nodes import is_group, node_subgroups
from plait.zero_sharding.zeropp.wire import (
    PendingComm,
    RowLayout,
    TwoHopComm,
    TwoHopQueue,
    dequantize_partial_sums,
    dequantize_rows,
    dequantize_sum_rows,
    quantize_rows,
)


class QuantizedGradientReducer:
    """qgZ: a :class:`~plait.zero_sharding.extension.GradientReducer` sending int4/int8 gradients.

    With ``node_size`` strictly between 1 and the group size it is hierarchical (see the module
    docstring) and must be constructed on every rank of ``group`` at the same point: it creates
    the intra-node and inter-node subgroups with ``torch.distributed.new_group``, a collective.

    Args:
        bits: bits per gradient code in the reduce-scatter (both hops): 4 (the ZeRO++ default) or 8.
        block_size: elements per fp32 scale, a power of two.
        gather_bits: bits of the all-gather half of :meth:`all_reduce` (which sends the already
            reduced sums back out); 8 by default, because an int4 second rounding would double
            the error of an int4 first one.
        node_size: ranks per node (consecutive ranks of ``group``); ``None``, 1 or the group
            size keep the flat single all-to-all.
        group: the sharding group the reducer is built for (``None``: the world).

    Raises:
        ValueError: unsupported bits, gather_bits or block_size; ``node_size`` not a positive
            int dividing the group size; torch.distributed not initialised with ``node_size > 1``.
    """

    def __init__(self, *, bits: int = 4, block_size: int = DEFAULT_BLOCK_SIZE, gather_bits: int = 8,
                 node_size: int | None = None, group: Any | None = None) -> None:
        _check_format("QuantizedGradientReducer", bits, block_size)
        _check_format("QuantizedGradientReducer (gather_bits)", gather_bits, block_size)
        self.bits, self.block_size, self.gather_bits = bits, block_size, gather_bits
        self.node_size, self.group = node_size, group
        self.ranks: list[int] | None = None  # the group's global ranks when hierarchical
        self.nodes = 1
        self.intra: Any = None  # this rank's node
        self.inter: Any = None  # the ranks with this rank's local index, one per node
        self._queue = TwoHopQueue()  # launched reductions whose hop 2 has not started
        if node_size is None:
            return
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
            raise ValueError(
                f"QuantizedGradientReducer: node_size={node_size!r} must be None (flat) or a positive int: the "
                f"number of ranks per node, e.g. 8."
            )
        if node_size == 1:
            return  # every rank its own node: the flat all-to-all is the inter-node hop
        if not dist.is_initialized():
            raise ValueError(
                f"QuantizedGradientReducer: node_size={node_size} needs torch.distributed initialised (it creates "
                f"node subgroups); call torch.distributed.init_process_group first."
            )
        world = dist.get_world_size(group)
        if world % node_size:
            raise ValueError(
                f"QuantizedGradientReducer: node_size={node_size} does not divide the group size {world}; pass the "
                f"number of ranks per node (a divisor of {world}), or None for the flat all-to-all."
            )
        if node_size < world:
            self._make_groups(world, node_size)

    def _make_groups(self, world: int, node_size: int) -> None:
        self.ranks, self.intra, self.inter = node_subgroups(self.group, node_size)
        self.nodes = world // node_size

    @property
    def hierarchical(self) -> bool:
        """Whether reductions over the group this reducer was built for take two hops."""
        return self.ranks is not None

    def _is_own_group(self, group: Any) -> bool:
        return is_group(group, self.group, self.ranks)

    def reduce_scatter(self, full: Tensor, shard_out: Tensor, *, group: Any, key: str) -> Any:
        """Write into ``shard_out`` the SUM over the group of this rank's slice of ``full``.

        Args:
            full: flat 1-D bucket of ``world * shard`` elements (fp32/bf16/fp16); rank ``r``'s
                slice is ``full[r * shard:(r + 1) * shard]``. Not modified.
            shard_out: 1-D tensor of ``shard`` elements, same dtype.
            group: the process group (``None`` for the world); when hierarchical, the group
                this reducer was built for.
            key: stable bucket id (names the inter-node hop; qgZ keeps no per-bucket state).

        Returns:
            A handle whose ``wait()`` completes ``shard_out`` (the first all-to-all runs
            asynchronously; the dequantize-and-sum happens in ``wait()``, and when hierarchical
            the inter-node hop starts at the next launch finding hop 1 arrived, else in
            ``wait()``), or ``None`` with one rank.

        Raises:
            ValueError: ``full`` is not ``world`` times the size of ``shard_out``, dtypes differ,
                or a hierarchical reducer is given a group other than its own.
        """
        world = dist.get_world_size(group)
        if full.numel() != world * shard_out.numel() or full.dtype != shard_out.dtype:
            raise ValueError(
                f"QuantizedGradientReducer.reduce_scatter: full must hold world * shard = {world} x "
                f"{shard_out.numel()} elements of {shard_out.dtype}; got {full.numel()} of {full.dtype}."
            )
        if world == 1:
            shard_out.copy_(full.view(-1))  # a sum over one rank: nothing to send, nothing to lose
            return None
        if self.hierarchical:
            if not self._is_own_group(group):
                raise ValueError(
                    f"QuantizedGradientReducer.reduce_scatter: this reducer was built with node_size="
                    f"{self.node_size} for the group of ranks {self.ranks}; build one reducer per sharding group."
                )
            return self._start_two_hops(full, shard_out, key)
        received, work, layout = self._start_all_to_all(full.reshape(world, -1), group)
        return PendingComm(work, lambda: shard_out.copy_(dequantize_sum_rows(received, layout)))

    def _start_all_to_all(self, rows: Tensor, group: Any, name: str | None = None) -> tuple[Tensor, Any, RowLayout]:
        """Quantize one row per destination and start the all-to-all; returns (received, work, layout)."""
        layout = RowLayout(rows.shape[1], self.bits, self.block_size)
        send = quantize_rows(rows, layout)
        received = torch.empty_like(send)
        work = collectives.all_to_all_single(received, send, group=group, async_op=True, name=name)
        return received, work, layout

    def _start_two_hops(self, full: Tensor, shard_out: Tensor, key: str) -> TwoHopComm:
        """Start hop 1; hop 2 starts once hop 1 has arrived (see :class:`TwoHopComm`)."""
        local, nodes, world = self.node_size or 1, self.nodes, self.nodes * (self.node_size or 1)
        layout = RowLayout(full.numel() // world, self.bits, self.block_size)
        # Rows are quantized one by one, so reordering the payload rows afterwards sends the same
        # bytes as quantizing reordered values, at 1/8 (int4) of the copy:
        # [node m, local l', payload] -> [l', m, payload]: peer l' gets the slices its counterparts own.
        payload = quantize_rows(full.reshape(world, -1), layout)
        send = payload.view(nodes, local, -1).transpose(0, 1).reshape(world, -1)
        received = torch.empty_like(send)
        work = collectives.all_to_all_single(received, send, group=self.intra, async_op=True,
                                             name="qgZ intra-node all-to-all")

        def inter_node_hop() -> tuple[Any, Any]:
            partial = dequantize_partial_sums(received, layout, local)  # [nodes, shard]: this node's sums
            inbound, hop2, hop2_layout = self._start_all_to_all(partial, self.inter,
                                                                f"qgZ inter-node all-to-all of `{key}`")
            return hop2, lambda: shard_out.copy_(dequantize_sum_rows(inbound, hop2_layout))

        handle = TwoHopComm(self._queue, work, inter_node_hop)
        self._queue.progress()  # earlier buckets whose hop 1 has arrived send their hop 2 now
        return handle

    def all_reduce(self, tensor: Tensor, *, group: Any, key: str) -> None:
        """In-place SUM of ``tensor`` over the group: a quantized reduce-scatter, then a quantized all-gather.

        Every rank ends with the same bits (all of them rebuild every slice from the same
        gathered codes, their own slice included). ``tensor`` is padded to a multiple of the
        group size internally. Over the group it was built for, a hierarchical reducer runs the
        two-hop reduce-scatter and gathers back in two hops too: the ``gather_bits`` payloads of
        the reduced slices across nodes (``N x P`` logical bytes), then, unchanged, inside the
        node (``W x P``). Over any other group (e.g. HSDP's replica group) it is flat.

        Args:
            tensor: any-shape contiguous floating tensor, reduced in place.
            group: the process group.
            key: stable id (names the inter-node hop).

        Returns:
            ``None``: the reduction is complete.

        Raises:
            ValueError: ``tensor`` is not contiguous.
        """
        if not tensor.is_contiguous():
            raise ValueError("QuantizedGradientReducer.all_reduce: tensor must be contiguous; pass .contiguous().")
        world = dist.get_world_size(group)
        if world == 1 or tensor.numel() == 0:
            return None
        numel = tensor.numel()
        shard = -(-numel // world)
        padded = torch.zeros(world * shard, dtype=tensor.dtype, device=tensor.device)
        padded[:numel] = tensor.view(-1)
        layout = RowLayout(shard, self.gather_bits, self.block_size)
        if self.hierarchical and self._is_own_group(group):
            reduced = torch.empty(shard, dtype=tensor.dtype, device=tensor.device)
            self._start_two_hops(padded, reduced, key).wait()  # the gather below needs the sums
            self._gather_two_hops(quantize_rows(reduced.view(1, -1), layout), layout, padded)
        else:
            received, work, rs_layout = self._start_all_to_all(padded.view(world, shard), group)
            work.wait()  # the gather below needs the sums: this half cannot overlap anything
            reduced = dequantize_sum_rows(received, rs_layout).to(tensor.dtype)
            mine = quantize_rows(reduced.view(1, -1), layout)
            gathered = torch.empty(world, layout.payload_bytes, dtype=torch.uint8, device=tensor.device)
            collectives.all_gather_into_tensor(gathered, mine, group=group)
            dequantize_rows(gathered, layout, padded)
        tensor.view(-1).copy_(padded[:numel])
        return None

    def _gather_two_hops(self, mine: Tensor, layout: RowLayout, out: Tensor) -> None:
        """All-gather every rank's payload row (across nodes, then inside the node) and dequantize into ``out``."""
        local, nodes = self.node_size or 1, self.nodes
        across = torch.empty(nodes, layout.payload_bytes, dtype=torch.uint8, device=mine.device)
        collectives.all_gather_into_tensor(across, mine, group=self.inter, name="qgZ inter-node all-gather")
        inside = torch.empty(local, nodes, layout.payload_bytes, dtype=torch.uint8, device=mine.device)
        collectives.all_gather_into_tensor(inside.view(-1), across.view(-1), group=self.intra,
                                           name="qgZ intra-node all-gather")
        # inside[l, m] is the payload of group rank m * L + l: reorder to rank order.
        dequantize_rows(inside.transpose(0, 1).reshape(local * nodes, -1), layout, out)
