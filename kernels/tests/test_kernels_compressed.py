"""1-bit sign packing and the error-compensated compressed all-reduce, against plain torch."""

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives as C
from plait.kernels.ops import compress_with_error_feedback, pack_signs, packed_numel, signs_reference, unpack_signs
from plait.kernels.testing import run_distributed


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 63, 1000])
def test_sign_pack_roundtrip_odd_sizes(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    if numel > 2:
        x[1] = 0.0  # zero counts as positive
        x[2] = -0.0  # so does negative zero (-0.0 >= 0)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(numel)
    assert torch.equal(unpack_signs(packed, numel), signs_reference(x))


def test_sign_pack_bit_order():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 2.0, -3.0])  # byte 0: bits 0 and 7; byte 1: bit 0 clear
    assert pack_signs(x).tolist() == [0b1000_0001, 0b1111_1110]


def test_error_feedback_keeps_what_compression_lost():
    x = torch.randn(37, generator=torch.Generator().manual_seed(1))
    error = torch.randn(37, generator=torch.Generator().manual_seed(2))
    compensated = x + error
    packed, scale = compress_with_error_feedback(x, error)
    decoded = unpack_signs(packed, 37) * scale
    assert torch.equal(error, compensated - decoded)  # the new error is exactly what the signs lost
    assert scale == torch.linalg.vector_norm(compensated) / 37**0.5


def test_bad_inputs_name_the_fix():
    with pytest.raises(TypeError, match="floating-point"):
        pack_signs(torch.arange(4))
    with pytest.raises(ValueError, match="numel"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="float32"):
        compress_with_error_feedback(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))


def _inputs(world: int, numel: int, calls: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(numel * 31 + world)
    n = C.compressed_numel(numel, world)
    out = []
    for _ in range(calls):
        per_rank = []
        for _ in range(world):
            buffer = torch.zeros(n)
            buffer[:numel] = torch.randn(numel, generator=gen)
            per_rank.append(buffer)
        out.append(per_rank)
    return out


def _compressed_rank(numel: int, calls: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = C.compressed_numel(numel, world)
    worker_error, server_error = torch.zeros(n), torch.zeros(n // world)
    results = []
    with C.ByteLedger() as ledger:
        for inputs in _inputs(world, numel, calls):
            results.append(C.compressed_allreduce(inputs[rank], worker_error, server_error))
    return {"results": results, "worker_error": worker_error, "server_error": server_error,
            "bytes": ledger.total(), "by_op": ledger.by_op()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_compressed_allreduce_equals_reference_bitwise(world):
    numel, calls = 101, 3  # odd: padded to a multiple of 8 x world
    outs = run_distributed(_compressed_rank, world, numel, calls, timeout=60)
    n = C.compressed_numel(numel, world)
    worker_errors = [torch.zeros(n) for _ in range(world)]
    server_errors = [torch.zeros(n // world) for _ in range(world)]
    for call, inputs in enumerate(_inputs(world, numel, calls)):
        expected = C.compressed_allreduce_reference(inputs, worker_errors, server_errors)
        for rank in range(world):
            assert torch.equal(outs[rank]["results"][call], expected), (call, rank)
    for rank in range(world):
        assert torch.equal(outs[rank]["worker_error"], worker_errors[rank])
        assert torch.equal(outs[rank]["server_error"], server_errors[rank])
        assert outs[rank]["bytes"] == calls * C.compressed_allreduce_nbytes(n, world)
        assert outs[rank]["by_op"] == {"all_to_all": calls * n // 8, "all_gather": calls * (n // 8 + 8 * world)}


def test_error_feedback_telescopes():
    # Nothing is lost, only delayed: the sum of the results over calls equals the sum of the true
    # means minus what the errors still hold at the end (worker errors averaged, server errors
    # concatenated by chunk). Equal up to fp32 rounding of 20 summed steps.
    world, numel, calls = 3, 96, 20
    outs = run_distributed(_compressed_rank, world, numel, calls, timeout=60)
    inputs = _inputs(world, numel, calls)
    true = sum(sum(per_rank) / world for per_rank in inputs)
    held = sum(out["worker_error"] for out in outs) / world + torch.cat([out["server_error"] for out in outs])
    torch.testing.assert_close(sum(outs[0]["results"]), true - held, atol=1e-4, rtol=1e-5)


def _bad_sizes() -> str:
    try:
        C.compressed_allreduce(torch.zeros(12), torch.zeros(12), torch.zeros(6))
    except ValueError as exc:
        return str(exc)
    return ""


def test_compressed_allreduce_refuses_unpadded_buffers():
    assert "compressed_numel" in run_distributed(_bad_sizes, 2, timeout=30)[0]
