"""The bytes ZeRO++ puts on the wire: quantized rows packed as one ``uint8`` payload per row.

A "row" is what one rank sends to one peer (qgZ: the slice of a gradient bucket that a
destination rank owns) or what one rank contributes to everyone (qwZ: its parameter shard). Each
row is quantized on its own with :func:`plait.kernels.ops.quantize.quantize_blockwise`, so block
boundaries never straddle two ranks' data and a receiver needs nothing but its own rows to
rebuild the values. A row's payload is its codes followed by the raw bytes of its fp32 scales::

    [ codes: code_numel(n, bits) bytes | scales: 4 * ceil(n / block_size) bytes ]

Codes and scales travel in one collective instead of two: one launch and one latency per
gather or all-to-all, and the byte ledger records exactly ``rows x payload_bytes``. Keeping the
scales in fp32 (not fp16) costs 2 more bytes per block (0.8% at block 256) and keeps the
bound ``|x - x_hat| <= scale / 2`` exact, with no overflow for large gradients.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from plait.kernels.ops.quantize import (
    SUPPORTED_BITS,
    code_dtype,
    code_numel,
    dequantize_blockwise,
    num_blocks,
    quantize_blockwise,
)


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Sizes of one quantized row of ``numel`` elements.

    Attributes:
        numel: elements in the row.
        bits: 8 or 4.
        block_size: elements per scale.
    """

    numel: int
    bits: int
    block_size: int

    def __post_init__(self) -> None:
        assert self.bits in SUPPORTED_BITS and self.numel >= 0, self  # validated by the configs upstream

    @property
    def code_bytes(self) -> int:
        """Bytes of codes (one per element for 8 bits, one per two elements for 4 bits)."""
        return code_numel(self.numel, self.bits)

    @property
    def blocks(self) -> int:
        """Number of quantization blocks (and fp32 scales)."""
        return num_blocks(self.numel, self.block_size)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one row on the wire: codes plus fp32 scales."""
        return self.code_bytes + 4 * self.blocks

    @property
    def padded_numel(self) -> int:
        """Elements in the row's whole blocks (the last one completed with zeros)."""
        return self.blocks * self.block_size

    @property
    def aligned(self) -> bool:
        """Whether rows end on block boundaries, so several rows quantize as one flat tensor."""
        return self.numel % self.block_size == 0


def quantize_rows(rows: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Quantize each row of ``rows`` on its own and pack codes and scales into one payload per row.

    Args:
        rows: ``[R, layout.numel]`` floating tensor (any of fp32/bf16/fp16).
        layout: the row layout.

    Returns:
        ``uint8 [R, layout.payload_bytes]``, contiguous (ready for a collective).
    """
    count = rows.shape[0]
    payload = torch.empty(count, layout.payload_bytes, dtype=torch.uint8, device=rows.device)
    if layout.aligned:
        # Rows end on block boundaries, so one kernel launch over all rows makes the same blocks.
        codes, scales = quantize_blockwise(rows, bits=layout.bits, block_size=layout.block_size)
        payload[:, :layout.code_bytes] = codes.view(torch.uint8).view(count, layout.code_bytes)
        payload[:, layout.code_bytes:] = scales.view(torch.uint8).view(count, 4 * layout.blocks)
        return payload
    # Row by row: padding every row to whole blocks first would be one call, but a fresh copy of
    # the whole bucket (measured: 3.4 -> 10 ms for 4 x 524352 fp32 rows when the allocator hands
    # that copy back to the OS in between, as it often does on CPU).
    for index in range(count):
        codes, scales = quantize_blockwise(rows[index], bits=layout.bits, block_size=layout.block_size)
        payload[index, :layout.code_bytes] = codes.view(torch.uint8)
        payload[index, layout.code_bytes:] = scales.view(torch.uint8)
    return payload


def dequantize_rows(payload: torch.Tensor, layout: RowLayout, out: torch.Tensor) -> torch.Tensor:
    """Rebuild the values of every row of ``payload`` into ``out``.

    Args:
        payload: ``uint8 [R, layout.payload_bytes]`` as :func:`quantize_rows` made it (possibly
            after a collective).
        layout: the row layout.
        out: contiguous floating tensor of ``R * layout.numel`` elements; row ``r`` lands in
            ``out.view(-1)[r * numel:(r + 1) * numel]``.

    Returns:
        ``out``.
    """
    if layout.aligned:
        _dequantize_whole_blocks(payload, layout, out.dtype, out=out)
        return out
    values = _dequantize_whole_blocks(payload, layout, out.dtype)
    out.view(payload.shape[0], layout.numel).copy_(values[:, :layout.numel])
    return out


def _dequantize_whole_blocks(payload: torch.Tensor, layout: RowLayout, dtype: torch.dtype,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Every row's values in one call, each row completed to whole blocks: ``[R, padded_numel]``.

    A row's codes end where its values do; behind them a zero code per padding element makes
    the values of the last block's padding (zeros, never used). One call instead of one per row,
    whose dozens of small op launches each cost more on a CPU than these small copies.
    """
    count = payload.shape[0]
    scales = payload[:, layout.code_bytes:].contiguous().view(torch.float32)
    padded_codes = code_numel(layout.padded_numel, layout.bits)
    if layout.aligned:
        codes = payload[:, :layout.code_bytes].contiguous()
    else:
        codes = torch.zeros(count, padded_codes, dtype=torch.uint8, device=payload.device)
        codes[:, :layout.code_bytes] = payload[:, :layout.code_bytes]
    values = dequantize_blockwise(codes.view(-1).view(code_dtype(layout.bits)), scales.view(-1), bits=layout.bits,
                                  block_size=layout.block_size, numel=count * layout.padded_numel, dtype=dtype,
                                  out=None if out is None else out.view(-1))
    return values.view(count, layout.padded_numel)


def dequantize_sum_rows(payload: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Dequantize every row to fp32 and sum them (the receiving side of a quantized reduce).

    Args:
        payload: ``uint8 [R, layout.payload_bytes]``.
        layout: the row layout.

    Returns:
        fp32 ``[layout.numel]``: the rows summed in row order (deterministic).
    """
    return _dequantize_whole_blocks(payload, layout, torch.float32)[:, :layout.numel].sum(dim=0)


def dequantize_partial_sums(payload: torch.Tensor, layout: RowLayout, sources: int) -> torch.Tensor:
    """Dequantize ``sources`` equal blocks of rows to fp32 and sum the blocks row by row.

    The receiving side of a two-hop reduce's first hop: block ``s`` holds source ``s``'s rows
    ``0..R/sources-1``, and row ``j`` of the result is the sum of row ``j`` of every block.

    Args:
        payload: ``uint8 [sources * rows, layout.payload_bytes]``, grouped by source.
        layout: the row layout.
        sources: number of blocks (ranks that sent rows); must divide ``payload.shape[0]``.

    Returns:
        fp32 ``[rows, layout.numel]``: the blocks summed in source order (deterministic).
    """
    rows = payload.shape[0] // sources
    assert rows * sources == payload.shape[0], (payload.shape, sources)
    values = _dequantize_whole_blocks(payload, layout, torch.float32).view(sources, rows, layout.padded_numel)
    return values[:, :, :layout.numel].sum(dim=0)


class PendingComm:
    """Handle of an in-flight quantized collective, as the engine's extension protocol expects.

    ``wait()`` waits for the collective (started with ``async_op=True``, so it overlaps whatever
    the caller does meanwhile, e.g. the previous unit's compute under prefetch) and then runs
    ``finish``, which rebuilds values from the received bytes. Waiting twice is harmless.

    Args:
        work: the collective's work handle, or ``None`` when nothing is in flight.
        finish: what to do once the bytes have arrived (dequantize into the output, keep state).
    """

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work, self._finish, self._done = work, finish, False

    def wait(self) -> None:
        """Complete the collective and the dequantization."""
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        self._finish()
        self._done = True


class TwoHopComm:
    """Handle of a reduction in two dependent collectives (inside the node, then across nodes).

    The second hop needs the first one's sums, so it can start only once the first has arrived.
    It starts at the earliest of: the owner's next launch finding the first hop complete
    (:meth:`TwoHopQueue.progress`, never blocking), or this handle's :meth:`wait`. Started early,
    the cross-node hop travels during the next units' backward instead of inside the wait.

    Args:
        queue: the owner's queue of reductions whose second hop has not started (this one is added).
        first: work handle of the first hop (``None``: already complete).
        start_second: called once the first hop is complete; issues the second hop asynchronously
            and returns ``(work, finish)``, ``finish`` writing the result once ``work`` is done.
    """

    def __init__(self, queue: TwoHopQueue, first: Any,
                 start_second: Callable[[], tuple[Any, Callable[[], None]]]) -> None:
        self._queue, self._first, self._start_second = queue, first, start_second
        self._second: Any = None
        self._finish: Callable[[], None] | None = None
        self._started = self._done = False
        queue.add(self)

    def first_complete(self) -> bool:
        """Whether the first hop has arrived (asks the work handle; never blocks)."""
        return self._first is None or bool(self._first.is_completed())

    def start_second(self) -> None:
        """Wait for the first hop (if still in flight) and issue the second (once)."""
        if self._started:
            return
        if self._first is not None:
            self._first.wait()
        self._second, self._finish = self._start_second()
        self._started, self._first, self._start_second = True, None, None  # type: ignore[assignment]

    def wait(self) -> None:
        """Complete both hops and write the result (waiting twice is harmless)."""
        if self._done:
            return
        self._queue.start_through(self)
        if self._second is not None:
            self._second.wait()
        assert self._finish is not None
        self._finish()
        # Drop the buffers the closures hold: the owner's queue may outlive the handle's use.
        self._done, self._second, self._finish = True, None, None


class TwoHopQueue:
    """A reducer's two-hop reductions whose second hop has not started, oldest first.

    Gloo matches the collectives of a process group by their order, so every rank must issue the
    second hops in the same order: launch order, here, whichever rank's first hops arrive first
    and in whatever order handles are waited.
    """

    def __init__(self) -> None:
        self._waiting: collections.deque[TwoHopComm] = collections.deque()

    def add(self, comm: TwoHopComm) -> None:
        """Queue a reduction just launched."""
        self._waiting.append(comm)

    def progress(self) -> None:
        """Start the second hop of the oldest reductions whose first hop has arrived (never blocks)."""
        while self._waiting and self._waiting[0].first_complete():
            self._waiting.popleft().start_second()

    def start_through(self, comm: TwoHopComm) -> None:
        """Start the second hop of every queued reduction up to ``comm`` (waiting for their first hops)."""
        if comm not in self._waiting:
            return
        while self._waiting:
            oldest = self._waiting.popleft()
            oldest.start_second()
            if oldest is comm:
                return
