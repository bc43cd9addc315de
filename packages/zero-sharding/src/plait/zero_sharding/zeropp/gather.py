"""ZeRO++ parameter gathers: quantized weights (qwZ) and the hierarchical secondary partition (hpZ).

Both implement :class:`plait.zero_sharding.extension.ParamGatherer`. They quantize at once, start
the collective asynchronously and return a :class:`~plait.zero_sharding.zeropp.wire.PendingComm`
whose ``wait()`` dequantizes once the bytes are in, so the engine's prefetch overlaps the
communication with compute as it does for the exact gather.

qwZ (:class:`QuantizedParamGatherer`): every rank quantizes its shard to int8 (or int4) blocks,
the codes and fp32 scales are all-gathered as one ``uint8`` payload, and every rank dequantizes
all shards, its own included, into the full buffer. Every rank therefore computes with the same
(quantized) weights; the fp32 master shards the optimizer updates stay exact. Phase ``"step"``
(refreshing replicated parameters after the optimizer step) gathers exactly, as the protocol
asks, so resident replicas never drift from the masters.

hpZ (:class:`HierarchicalParamGatherer`): ranks are split into consecutive blocks of
``partition_size`` (a "node"). The forward gather runs over the whole group (through ``inner``,
e.g. qwZ), and each rank keeps a secondary shard: its ``1/partition_size`` part of the full
parameter, so the ranks of a node together hold the whole parameter again. The backward gather
then all-gathers only inside the node from those secondary shards: no bytes cross nodes.
Memory cost: the secondary shard, ``Psi / partition_size`` elements per rank per parameter unit
(kept from one forward to the next; with a quantized ``inner`` it is held as the int8/int4
codes plus scales that arrived in the forward, so it costs ``Psi / partition_size`` bytes at 8
bits and the backward rebuilds bit for bit the weights the forward used).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plait.kernels import collectives
from plait.kernels.ops.quantize import SUPPORTED_BITS
from plait.zero_sharding.extension import GATHER_PHASES, DefaultGatherer
from plait.zero_sharding.zeropp.wire import PendingComm, RowLayout, dequantize_rows, quantize_rows

DEFAULT_BLOCK_SIZE = 256


def _check_call(shard: Tensor, full_out: Tensor, world: int, phase: str, who: str) -> None:
    if phase not in GATHER_PHASES:
        raise ValueError(f"{who}.all_gather: phase={phase!r} is unknown; use one of {GATHER_PHASES}.")
    if full_out.numel() != world * shard.numel() or full_out.dtype != shard.dtype:
        raise ValueError(
            f"{who}.all_gather: full_out must hold world * shard = {world} x {shard.numel()} elements of "
            f"{shard.dtype}; got {full_out.numel()} of {full_out.dtype}. Pass the unit's full flat buffer."
        )
    if not full_out.is_contiguous():
        raise ValueError(f"{who}.all_gather: full_out must be contiguous; pass the unit's flat buffer.")


def _check_format(who: str, bits: object, block_size: object) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{who}: bits={bits!r} is not supported; use 8 (int8) or 4 (packed int4).")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 \
            or block_size & (block_size - 1) or block_size > 65536:
        raise ValueError(f"{who}: block_size={block_size!r} must be a power of two in [2, 65536], e.g. 256.")


class QuantizedParamGatherer:
    """qwZ: all-gather parameter shards as blockwise int8 (or int4) codes plus fp32 scales.

    Logical bytes per gather (the ledger's all-gather output): ``world x (code bytes + 4 x blocks)``
    of the shard, e.g. ``Psi x (1 + 4 / block_size)`` bytes at 8 bits instead of ``Psi x itemsize``.

    Args:
        bits: 8 (the ZeRO++ default) or 4.
        block_size: elements per fp32 scale, a power of two (256: 1.6% scale overhead).

    Raises:
        ValueError: unsupported bits or block_size.
    """

    def __init__(self, *, bits: int = 8, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        _check_format("QuantizedParamGatherer", bits, block_size)
        self.bits, self.block_size = bits, block_size
        self._exact = DefaultGatherer()

    def layout(self, shard_numel: int) -> RowLayout:
        """The wire layout of one rank's shard of ``shard_numel`` elements."""
        return RowLayout(shard_numel, self.bits, self.block_size)

    def all_gather(self, shard: Tensor, full_out: Tensor, *, group: Any, key: str, phase: str) -> Any:
        """Gather every rank's ``shard`` into ``full_out`` (quantized except in phase ``"step"``).

        Args:
            shard: this rank's 1-D shard (fp32/bf16/fp16); read before this call returns.
            full_out: contiguous 1-D buffer of ``world * shard.numel()`` elements, same dtype.
            group: the process group (``None`` for the world).
            key: stable id of the unit (unused: qwZ keeps no per-unit state).
            phase: ``"forward"``, ``"backward"`` or ``"step"`` (exact).

        Returns:
            A handle whose ``wait()`` completes ``full_out``, or ``None`` when already complete.

        Raises:
            ValueError: unknown phase, or ``full_out`` of the wrong size, dtype or layout.
        """
        world = dist.get_world_size(group)
        _check_call(shard, full_out, world, phase, "QuantizedParamGatherer")
        if world == 1:
            full_out.copy_(shard.view(-1))  # one rank: nothing to send, so nothing to quantize
            return None
        if phase == "step":
            return self._exact.all_gather(shard, full_out, group=group, key=key, phase=phase)
        payload, work = self.start_gather(shard, group=group)
        return PendingComm(work, lambda: self.unpack(payload, full_out))

    def start_gather(self, shard: Tensor, *, group: Any) -> tuple[Tensor, Any]:
        """Quantize ``shard`` and start the all-gather of every rank's payload.

        Args:
            shard: this rank's 1-D shard.
            group: the process group.

        Returns:
            ``(payload, work)``: ``uint8 [world, payload_bytes]`` (row ``r`` is rank ``r``'s
            quantized shard; valid once ``work.wait()`` returned) and the collective's handle.
        """
        layout = self.layout(shard.numel())
        mine = quantize_rows(shard.reshape(1, -1), layout)
        world = dist.get_world_size(group)
        gathered = torch.empty(world, layout.payload_bytes, dtype=torch.uint8, device=shard.device)
        work = collectives.all_gather_into_tensor(gathered, mine, group=group, async_op=True)
        return gathered, work

    def unpack(self, payload: Tensor, full_out: Tensor) -> None:
        """Dequantize a gathered payload (``[world, payload_bytes]``) into ``full_out``."""
        shard_numel = full_out.numel() // payload.shape[0]
        dequantize_rows(payload, self.layout(shard_numel), full_out)


class HierarchicalParamGatherer:
    """hpZ: forward gathers over the whole group; backward gathers inside a node from secondary shards.

    Must be constructed on every rank of ``group`` at the same point (it creates the node
    subgroups with ``torch.distributed.new_group``, a collective call).

    Args:
        partition_size: ranks per node (consecutive group ranks); must divide the group size.
            1 keeps the whole parameter on every rank (backward needs no communication at all).
        inner: the gatherer used for the forward (and for a backward without a secondary shard,
            and for ``"step"``); a :class:`QuantizedParamGatherer` makes the secondary shard its
            codes. Default: the exact :class:`~plait.zero_sharding.extension.DefaultGatherer`.
        group: the process group the units are sharded over (``None``: the world).

    Raises:
        ValueError: ``partition_size`` is not a positive divisor of the group size, or the
            default process group is not initialised.
    """

    def __init__(self, *, partition_size: int, inner: Any | None = None, group: Any | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "HierarchicalParamGatherer needs torch.distributed initialised (it creates node subgroups); "
                "call torch.distributed.init_process_group first."
            )
        world = dist.get_world_size(group)
        if isinstance(partition_size, bool) or not isinstance(partition_size, int) or partition_size < 1 \
                or world % partition_size:
            raise ValueError(
                f"HierarchicalParamGatherer: partition_size={partition_size!r} must be a positive divisor of "
                f"the group size {world}; pass the number of ranks per node, e.g. {min(world, 8)}."
            )
        self.partition_size, self.group, self.world = partition_size, group, world
        self.inner = inner if inner is not None else DefaultGatherer()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        group_rank = dist.get_rank(group)
        self.node_index, self.node_rank = divmod(group_rank, partition_size)
        self.subgroup: Any = None
        if partition_size == world:
            self.subgroup = group
        elif partition_size > 1:
            # Every rank creates every node's group, in the same order: new_group is collective.
            for node in range(world // partition_size):
                created = dist.new_group(ranks[node * partition_size:(node + 1) * partition_size],
                                         timeout=collectives.group_timeout())
                if node == self.node_index:
                    self.subgroup = created
        # key -> (secondary shard, whether it holds qwZ payload rows rather than values)
        self._secondary: dict[str, tuple[Tensor, bool]] = {}

    def all_gather(self, shard: Tensor, full_out: Tensor, *, group: Any, key: str, phase: str) -> Any:
        """Gather ``full_out``: over the group in ``"forward"``/``"step"``, inside the node in ``"backward"``.

        A backward gather of a unit with no secondary shard (no forward gather since the last
        step, e.g. a unit that stayed gathered) falls back to ``inner`` over the whole group.

        Args:
            shard: this rank's 1-D shard.
            full_out: contiguous 1-D buffer of ``world * shard.numel()`` elements, same dtype.
            group: the process group; must be the one this gatherer was built for.
            key: stable id of the unit: secondary shards are kept per key.
            phase: ``"forward"``, ``"backward"`` or ``"step"``.

        Returns:
            A handle whose ``wait()`` completes ``full_out`` (and, in the forward, keeps the
            secondary shard), or ``None`` when already complete.

        Raises:
            ValueError: unknown phase, a group of another size, or a wrongly sized ``full_out``.
        """
        world = dist.get_world_size(group)
        _check_call(shard, full_out, world, phase, "HierarchicalParamGatherer")
        if world != self.world:
            raise ValueError(
                f"HierarchicalParamGatherer.all_gather: group has {world} ranks but this gatherer was built for "
                f"{self.world}; build one gatherer per sharding group."
            )
        if world == 1:
            return self.inner.all_gather(shard, full_out, group=group, key=key, phase=phase)  # a local copy
        if phase == "backward" and key in self._secondary:
            return self._gather_in_node(key, full_out)
        if phase == "forward":
            return self._gather_forward(shard, full_out, group, key)
        # "step" changes the parameters: a kept secondary shard would be stale.
        self._secondary.pop(key, None)
        return self.inner.all_gather(shard, full_out, group=group, key=key, phase=phase)

    def _gather_forward(self, shard: Tensor, full_out: Tensor, group: Any, key: str) -> PendingComm:
        if isinstance(self.inner, QuantizedParamGatherer):
            inner = self.inner
            payload, work = inner.start_gather(shard, group=group)
            rows = self.world // self.partition_size  # rank shards per secondary shard
            start = self.node_rank * rows

            def finish() -> None:
                inner.unpack(payload, full_out)
                self._secondary[key] = (payload[start:start + rows].clone(), True)

            return PendingComm(work, finish)
        handle = self.inner.all_gather(shard, full_out, group=group, key=key, phase="forward")
        part = full_out.numel() // self.partition_size
        start = self.node_rank * part

        def keep_values() -> None:
            self._secondary[key] = (full_out[start:start + part].clone(), False)

        return PendingComm(handle, keep_values)

    def _gather_in_node(self, key: str, full_out: Tensor) -> PendingComm:
        secondary, quantized = self._secondary[key]
        if quantized:
            gathered = torch.empty(self.world, secondary.shape[1], dtype=torch.uint8, device=secondary.device)
        else:
            gathered = full_out
        work = None
        if self.partition_size == 1:
            gathered.view(-1).copy_(secondary.view(-1))  # the whole parameter is local: nothing to send
        else:
            work = collectives.all_gather_into_tensor(gathered.view(-1), secondary.view(-1), group=self.subgroup,
                                                      async_op=True)
        if quantized:
            return PendingComm(work, lambda: self.inner.unpack(gathered, full_out))
        return PendingComm(work, lambda: None)

    def secondary_nbytes(self) -> int:
        """Bytes this rank holds in secondary shards (the hpZ memory cost), over all units."""
        return sum(t.numel() * t.element_size() for t, _ in self._secondary.values())

    def clear(self) -> None:
        """Drop every secondary shard (frees their memory; backward falls back to ``inner``)."""
        self._secondary.clear()
