"""The error-compensated 1-bit all-reduce of 1-bit Adam, 1-bit LAMB and 0/1 Adam.

Every rank holds a flat fp32 buffer of ``n`` elements (``n`` a multiple of ``8 x world``:
:func:`compressed_numel` pads). Rank ``r`` is the *server* of chunk ``r`` (``n / world``
elements). One call:

1. worker: ``c = buffer + worker_error``; send ``sign(c)`` packed 8 to a byte and one fp32
   scale ``||c|| / sqrt(n)``; ``worker_error <- c - scale * sign(c)``;
2. all-to-all of the packed signs (each server receives its chunk from every worker) and an
   all-gather of the worker scales;
3. server: ``s = (sum over workers w, in rank order, of sign_w * scale_w) * (1 / world) +
   server_error``, compressed the same way into its chunk's signs and one scale, with
   ``server_error <- s - scale_s * sign(s)``;
4. all-gather of the server signs and of the server scales; every rank decodes the same result.

Logical bytes per call (the ledger's units): all-to-all ``n / 8``, all-gathers ``n / 8`` and
``2 x 4 x world``: :func:`compressed_allreduce_nbytes`. An fp32 all-reduce of the same buffer is
``2 x 4n`` in volume units (an all-reduce counts twice), so the 1-bit exchange is 1/32 of it plus
the scales.

Both error buffers carry state across calls, so the exchange is biased at any one step but the
error does not accumulate (the optimizers' convergence argument). :func:`compressed_allreduce_reference`
is the same algorithm written plainly over all ranks' inputs in one process: the test oracle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.collectives.ops import all_gather_into_tensor, all_to_all_single
from plait.kernels.ops.sign import (
    compress_with_error_feedback,
    packed_numel,
    signs_reference,
    unpack_scaled_signs,
)

FP32 = 4
# Elements per piece of the server's decode-and-sum: 1 MiB of fp32 (a multiple of 8: whole bytes).
_PIECE = 1 << 18


def compressed_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 x world_size``: the buffer size the all-reduce needs.

    Args:
        numel: elements to exchange.
        world_size: ranks in the group.

    Returns:
        The padded element count (the worker-error size; the server error is that / world).
    """
    unit = 8 * world_size
    return -(-numel // unit) * unit


def compressed_allreduce_nbytes(numel: int, world_size: int) -> int:
    """Logical bytes one :func:`compressed_allreduce` of ``numel`` padded elements records per rank.

    Args:
        numel: the padded buffer size (a multiple of ``8 x world_size``).
        world_size: ranks in the group.

    Returns:
        ``numel / 8`` (all-to-all) ``+ numel / 8`` (sign all-gather) ``+ 2 x 4 x world_size``
        (the two scale all-gathers).
    """
    return 2 * packed_numel(numel) + 2 * FP32 * world_size


def compressed_allreduce(
    buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, *, group: Any | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Average ``buffer`` over the group in 1 bit per element, with worker and server error feedback.

    Args:
        buffer: flat fp32 tensor of ``n`` elements, ``n`` a multiple of ``8 x world`` (pad with
            :func:`compressed_numel`; padding elements should be zero). Not modified, unless it
            is also ``out``.
        worker_error: this rank's flat fp32 error of ``n`` elements, updated in place.
        server_error: this rank's flat fp32 error of its server chunk, ``n / world`` elements,
            updated in place.
        group: the process group (``None``: the default group).
        out: optional flat fp32 tensor of ``n`` elements for the result, so a caller that
            exchanges every step allocates nothing of the buffer's size (fresh pages of a large
            tensor cost more than the arithmetic on CPU). It may be ``buffer`` itself: the buffer
            is read once, at the start, before anything is written to ``out``.

    Returns:
        A flat fp32 tensor of ``n`` elements (``out`` when given), equal on every rank: the
        compressed average.

    Raises:
        ValueError: sizes or dtypes that do not fit (the message says which and the fix).
    """
    world = dist.get_world_size(group)
    n = buffer.numel()
    _check_buffers(buffer, worker_error, server_error, world)
    if out is None:
        out = torch.empty_like(buffer)
    elif out.shape != buffer.shape or out.dtype != torch.float32:
        raise ValueError(f"compressed_allreduce: out must be float32 of shape {tuple(buffer.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}; pass a tensor like the buffer, or none.")
    chunk = n // world
    packed, worker_scale = compress_with_error_feedback(buffer, worker_error)
    received = torch.empty_like(packed)
    all_to_all_single(received, packed, group=group, name="1-bit compressed all-reduce: worker-sign all-to-all")
    worker_scales = buffer.new_empty(world)
    all_gather_into_tensor(worker_scales, worker_scale.reshape(1), group=group,
                           name="1-bit compressed all-reduce: worker-scale all-gather")

    # The server average is built in this rank's own chunk of ``out``: free until the final decode.
    rank = dist.get_rank(group)
    server = _server_average(received.view(world, -1), worker_scales, out[rank * chunk: (rank + 1) * chunk])
    server_packed, server_scale = compress_with_error_feedback(server, server_error)
    all_packed = torch.empty(world * server_packed.numel(), dtype=torch.uint8, device=buffer.device)
    all_gather_into_tensor(all_packed, server_packed, group=group,
                           name="1-bit compressed all-reduce: server-sign all-gather")
    server_scales = buffer.new_empty(world)
    all_gather_into_tensor(server_scales, server_scale.reshape(1), group=group,
                           name="1-bit compressed all-reduce: server-scale all-gather")
    for server_rank, signs in enumerate(all_packed.view(world, -1)):
        unpack_scaled_signs(signs, chunk, server_scales[server_rank],
                            out=out[server_rank * chunk: (server_rank + 1) * chunk])
    return out


def _server_average(signs: torch.Tensor, scales: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Sum of ``sign_w x scale_w`` over workers in rank order, times ``1 / world`` (fp32), into
    ``total`` (a flat fp32 tensor of one chunk, overwritten)."""
    total.zero_()  # the reference's order, 0 + s_0 + s_1 + ..., kept to the bit
    decoded = torch.empty(min(_PIECE, total.numel()), dtype=torch.float32, device=total.device)
    for start in range(0, total.numel(), _PIECE):  # piece by piece: a small reused temporary, in cache
        part = total[start: start + _PIECE]
        for worker in range(signs.shape[0]):
            part += unpack_scaled_signs(signs[worker, start // 8:], part.numel(), scales[worker],
                                        out=decoded[: part.numel()])
    return total.mul_(1.0 / signs.shape[0])


def compressed_allreduce_reference(
    buffers: list[torch.Tensor], worker_errors: list[torch.Tensor], server_errors: list[torch.Tensor]
) -> torch.Tensor:
    """The same algorithm over every rank's buffers in one process, without packing: the oracle.

    Args:
        buffers: rank ``w``'s flat fp32 buffer at index ``w`` (all of one padded size).
        worker_errors: each rank's worker error, updated in place.
        server_errors: each rank's server error (its chunk), updated in place.

    Returns:
        The flat fp32 result every rank receives.
    """
    world = len(buffers)
    chunk = buffers[0].numel() // world
    signs, scales = [], []
    for buffer, error in zip(buffers, worker_errors):
        compensated = buffer + error
        scale = torch.linalg.vector_norm(compensated) / compensated.numel() ** 0.5
        error.copy_(compensated - scale * signs_reference(compensated))
        signs.append(signs_reference(compensated))
        scales.append(scale)
    pieces = []
    for server in range(world):
        part = slice(server * chunk, (server + 1) * chunk)
        total = torch.zeros(chunk)
        for worker in range(world):
            total += signs[worker][part] * scales[worker]
        compensated = total.mul_(1.0 / world) + server_errors[server]
        scale = torch.linalg.vector_norm(compensated) / compensated.numel() ** 0.5
        server_errors[server].copy_(compensated - scale * signs_reference(compensated))
        pieces.append(signs_reference(compensated) * scale)
    return torch.cat(pieces)


def _check_buffers(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, world: int) -> None:
    n = buffer.numel()
    if buffer.dtype != torch.float32 or buffer.dim() != 1 or n % (8 * world):
        raise ValueError(
            f"compressed_allreduce: buffer must be flat float32 with a size divisible by 8 x world = {8 * world}, "
            f"got dtype={buffer.dtype}, shape={tuple(buffer.shape)}; pad it to compressed_numel(numel, world)."
        )
    if worker_error.shape != buffer.shape or worker_error.dtype != torch.float32:
        raise ValueError(
            f"compressed_allreduce: worker_error must be float32 of shape {tuple(buffer.shape)}, "
            f"got {worker_error.dtype} {tuple(worker_error.shape)}; allocate one per buffer and keep it."
        )
    if server_error.shape != (n // world,) or server_error.dtype != torch.float32:
        raise ValueError(
            f"compressed_allreduce: server_error must be float32 of shape ({n // world},) (the buffer / world), "
            f"got {server_error.dtype} {tuple(server_error.shape)}."
        )


__all__ = [
    "compressed_allreduce", "compressed_allreduce_nbytes", "compressed_allreduce_reference", "compressed_numel",
]
