"""The CPU path of the 1-bit compression on buffers larger than one of its pieces, bit for bit.

The torch (CPU) code of ``compress_with_error_feedback`` works piece by piece and decodes with a
table gather, and ``compressed_allreduce`` can write its result into its own input buffer
(``out=buffer``, as the optimizers' exchange does). These tests hold all of that to the algorithm
written plainly (sign, shift, sum), on sizes that span several pieces and end in a partial byte.
"""

from __future__ import annotations

import math

import pytest
import torch

from plait.kernels import collectives as C
from plait.kernels.ops import compress_with_error_feedback, signs_reference, unpack_signs
from plait.kernels.ops.sign import unpack_scaled_signs
from plait.kernels.testing import run_distributed

PIECE = 1 << 18  # plait.kernels.ops.sign._PIECE: sizes below straddle it
SIZES = (PIECE - 3, 2 * PIECE + 8 * 5 + 3, 3 * PIECE)


def plain_pack(x: torch.Tensor) -> torch.Tensor:
    """Bit ``i`` of byte ``j`` is ``x[8j + i] >= 0``; a partial last byte padded with 1 bits."""
    bits = (x >= 0).to(torch.int64)
    bits = torch.cat((bits, torch.ones(-x.numel() % 8, dtype=torch.int64)))
    return (bits.view(-1, 8) << torch.arange(8)).sum(dim=1).to(torch.uint8)


def plain_unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """+1.0 / -1.0 from the bits, the format read plainly."""
    bits = (packed.to(torch.int64).view(-1, 1) >> torch.arange(8)) & 1
    return (bits.reshape(-1)[:numel] * 2 - 1).to(torch.float32)


def _data(numel: int, seed: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[::11] = 0.0
    x[3::13] = -0.0  # counts as positive
    return x


@pytest.mark.parametrize("numel", SIZES)
def test_compress_with_error_feedback_is_the_plain_algorithm(numel):
    x, error = _data(numel, 1), _data(numel, 2) * 0.1
    compensated = x + error
    scale = torch.linalg.vector_norm(compensated) / math.sqrt(numel)
    want_error = compensated - scale * signs_reference(compensated)
    packed, got_scale = compress_with_error_feedback(x, error)
    assert torch.equal(packed, plain_pack(compensated))
    assert torch.equal(got_scale, scale)
    assert torch.equal(error.view(torch.int32), want_error.view(torch.int32))  # zeros' signs included


@pytest.mark.parametrize("numel", SIZES)
def test_unpack_scaled_signs_is_signs_times_scale(numel):
    packed = plain_pack(_data(numel, 3))
    scale = torch.tensor(0.375)
    want = plain_unpack(packed, numel) * scale
    assert torch.equal(unpack_signs(packed, numel), plain_unpack(packed, numel))
    assert torch.equal(unpack_scaled_signs(packed, numel, scale), want)
    out = torch.full((numel,), float("nan"))
    assert unpack_scaled_signs(packed, numel, scale, out=out) is out and torch.equal(out, want)


def _allreduce_in_place(numel: int) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    n = C.compressed_numel(numel, world)
    buffers = [torch.nn.functional.pad(_data(numel, 10 + r), (0, n - numel)) for r in range(world)]
    worker_error, server_error = torch.zeros(n), torch.zeros(n // world)
    results = []
    for _ in range(2):  # twice: the second call starts from non-zero error feedback
        buffer = buffers[rank].clone()
        results.append(C.compressed_allreduce(buffer, worker_error, server_error, out=buffer).clone())
    return {"results": results, "buffers": buffers}


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_allreduce_into_its_own_buffer_equals_the_reference(world):
    outs = run_distributed(_allreduce_in_place, world, 2 * PIECE + 19, timeout=120)
    buffers = outs[0]["buffers"]
    n = buffers[0].numel()
    worker_errors = [torch.zeros(n) for _ in range(world)]
    server_errors = [torch.zeros(n // world) for _ in range(world)]
    for call in range(2):
        want = C.compressed_allreduce_reference([b.clone() for b in buffers], worker_errors, server_errors)
        for out in outs:
            assert torch.equal(out["results"][call], want)
