"""ZeRO++ quantized gradient reduction (qgZ): quantize, all-to-all, dequantize and sum in fp32.

A ring reduce-scatter adds partial sums hop by hop, so quantizing it would quantize (and lose
precision) once per hop. qgZ instead quantizes each gradient once: every rank cuts its bucket
into one slice per destination rank, quantizes each slice on its own (int4 by default, or int8),
and one all-to-all delivers to every rank the quantized copies of its own slice from all
ranks. The receiver dequantizes them and sums in fp32, so the reduction itself adds no error
beyond the one quantization of each input.

One node, one hop: DeepSpeed's qgZ does two all-to-alls (inside the node, then across nodes,
re-quantizing the intra-node partial sums in between) so that the slow inter-node link carries
already-reduced data. plait's CPU and single-node setups have one level, where the single
all-to-all is the whole algorithm; a hierarchical two-hop version only pays off across nodes
and is not implemented.

Logical bytes per reduce-scatter (the all-to-all input this rank sends, its own slice included,
as torch counts it): ``world x (code bytes + 4 x blocks)`` of one slice, e.g.
``Psi x (0.5 + 4 / block_size)`` bytes at 4 bits instead of ``Psi x itemsize``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plait.kernels import collectives
from plait.zero_sharding.zeropp.gather import DEFAULT_BLOCK_SIZE, _check_format
from plait.zero_sharding.zeropp.wire import (
    PendingComm,
    RowLayout,
    dequantize_rows,
    dequantize_sum_rows,
    quantize_rows,
)


class QuantizedGradientReducer:
    """qgZ: a :class:`~plait.zero_sharding.extension.GradientReducer` sending int4/int8 gradients.

    Args:
        bits: bits per gradient code in the reduce-scatter: 4 (the ZeRO++ default) or 8.
        block_size: elements per fp32 scale, a power of two.
        gather_bits: bits of the all-gather half of :meth:`all_reduce` (which sends the already
            reduced sums back out); 8 by default, because an int4 second rounding would double
            the error of an int4 first one.

    Raises:
        ValueError: unsupported bits, gather_bits or block_size.
    """

    def __init__(self, *, bits: int = 4, block_size: int = DEFAULT_BLOCK_SIZE, gather_bits: int = 8) -> None:
        _check_format("QuantizedGradientReducer", bits, block_size)
        _check_format("QuantizedGradientReducer (gather_bits)", gather_bits, block_size)
        self.bits, self.block_size, self.gather_bits = bits, block_size, gather_bits

    def reduce_scatter(self, full: Tensor, shard_out: Tensor, *, group: Any, key: str) -> Any:
        """Write into ``shard_out`` the SUM over the group of this rank's slice of ``full``.

        Args:
            full: flat 1-D bucket of ``world * shard`` elements (fp32/bf16/fp16); rank ``r``'s
                slice is ``full[r * shard:(r + 1) * shard]``. Not modified.
            shard_out: 1-D tensor of ``shard`` elements, same dtype.
            group: the process group (``None`` for the world).
            key: stable bucket id (unused: qgZ keeps no per-bucket state).

        Returns:
            A handle whose ``wait()`` completes ``shard_out`` (the all-to-all runs asynchronously,
            the dequantize-and-sum happens in ``wait()``), or ``None`` with one rank.

        Raises:
            ValueError: ``full`` is not ``world`` times the size of ``shard_out``, or dtypes differ.
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
        received, work, layout = self._start_all_to_all(full.reshape(world, -1), group)
        return PendingComm(work, lambda: shard_out.copy_(dequantize_sum_rows(received, layout)))

    def _start_all_to_all(self, rows: Tensor, group: Any) -> tuple[Tensor, Any, RowLayout]:
        """Quantize one row per destination and start the all-to-all; returns (received, work, layout)."""
        layout = RowLayout(rows.shape[1], self.bits, self.block_size)
        send = quantize_rows(rows, layout)
        received = torch.empty_like(send)
        work = collectives.all_to_all_single(received, send, group=group, async_op=True)
        return received, work, layout

    def all_reduce(self, tensor: Tensor, *, group: Any, key: str) -> None:
        """In-place SUM of ``tensor`` over the group: a quantized reduce-scatter, then a quantized all-gather.

        Every rank ends with the same bits (all of them rebuild every slice from the same
        gathered codes, their own slice included). ``tensor`` is padded to a multiple of the
        group size internally.

        Args:
            tensor: any-shape contiguous floating tensor, reduced in place.
            group: the process group.
            key: stable id (unused).

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
        received, work, rs_layout = self._start_all_to_all(padded.view(world, shard), group)
        work.wait()  # the gather below needs the sums: this half cannot overlap anything
        reduced = dequantize_sum_rows(received, rs_layout).to(tensor.dtype)
        layout = RowLayout(shard, self.gather_bits, self.block_size)
        mine = quantize_rows(reduced.view(1, -1), layout)
        gathered = torch.empty(world, layout.payload_bytes, dtype=torch.uint8, device=tensor.device)
        collectives.all_gather_into_tensor(gathered, mine, group=group)
        dequantize_rows(gathered, layout, padded)
        tensor.view(-1).copy_(padded[:numel])
        return None
