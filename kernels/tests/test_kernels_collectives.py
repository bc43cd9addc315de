"""The byte ledger counts every collective exactly, for plait's wrappers and for peers."""

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives as C
from plait.kernels.testing import run_distributed

FP32 = 4


def _every_collective() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 10  # odd on purpose: nothing here assumes divisibility beyond what the op requires
    with C.ByteLedger() as ledger:
        full = torch.empty(world * n)
        C.all_gather_into_tensor(full, torch.full((n,), float(rank)))
        assert full.view(world, n)[:, 0].tolist() == [float(r) for r in range(world)]

        parts = [torch.empty(3) for _ in range(world)]  # list form (gloo needs equal sizes)
        C.all_gather(parts, torch.full((3,), float(rank)))
        assert [p[0].item() for p in parts] == [float(r) for r in range(world)]

        shard = torch.empty(n)
        C.reduce_scatter_tensor(shard, torch.ones(world * n))
        assert torch.equal(shard, torch.full((n,), float(world)))

        summed = torch.full((n,), 1.0)
        C.all_reduce(summed)
        assert torch.equal(summed, torch.full((n,), float(world)))

        # uneven all-to-all: rank r sends (dst + 1) elements to rank dst
        in_splits = [dst + 1 for dst in range(world)]
        out_splits = [rank + 1] * world
        out = torch.empty(sum(out_splits))
        C.all_to_all_single(out, torch.full((sum(in_splits),), float(rank)),
                            output_split_sizes=out_splits, input_split_sizes=in_splits)
        assert out.tolist() == [float(src) for src in range(world) for _ in range(rank + 1)]

        b = torch.full((n,), float(rank))
        C.broadcast(b, src=0)
        assert torch.equal(b, torch.zeros(n))

        work = C.all_reduce(torch.ones(3), async_op=True)
        work.wait()

        if world >= 2:  # ring of point-to-point messages, blocking and async
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            got = torch.empty(5)
            if rank % 2 == 0:
                C.send(torch.full((5,), float(rank)), dst=nxt)
                C.recv(got, src=prv)
            else:
                C.recv(got, src=prv)
                C.send(torch.full((5,), float(rank)), dst=nxt)
            assert got[0].item() == float(prv)
            reqs = [C.isend(torch.ones(7), dst=nxt), C.irecv(torch.empty(7), src=prv)]
            for req in reqs:
                req.wait()
        C.barrier()
    return {"by_op": ledger.by_op(), "total": ledger.total(), "volume": ledger.volume(),
            "count": ledger.count(), "groups": ledger.by_group()}


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_is_counted_exactly(world):
    results = run_distributed(_every_collective, world, timeout=90)
    n = 10
    for rank, got in enumerate(results):
        expected = {
            "all_gather": (world * n + world * 3) * FP32,
            "reduce_scatter": world * n * FP32,
            "all_reduce": (n + 3) * FP32,
            "all_to_all": sum(dst + 1 for dst in range(world)) * FP32,
            "broadcast": n * FP32,
            "send": (5 + 7) * FP32,
            "recv": (5 + 7) * FP32,
        }
        assert got["by_op"] == expected, f"rank {rank}"
        assert got["total"] == sum(expected.values())
        assert got["volume"] == sum(expected.values()) + expected["all_reduce"]  # all-reduce counts twice
        assert got["groups"] == {"world": got["total"]}


def _subgroup_names() -> dict:
    rank = dist.get_rank()
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    with C.ByteLedger() as ledger:
        C.all_reduce(torch.ones(4), group=mine)
        C.all_reduce(torch.ones(2))
    return ledger.by_group()


def test_bytes_are_kept_per_process_group():
    results = run_distributed(_subgroup_names, 4, timeout=90)
    assert results[0] == {"ranks[0,2]": 16, "world": 8}
    assert results[1] == {"ranks[1,3]": 16, "world": 8}


def _ddp_step_counted_from_outside() -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    numel = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    C.count_ddp(ddp)
    reference = [p.detach().clone() for p in model.parameters()]
    # inside count_torch_distributed too: the hook's all-reduce must still be counted once
    with C.ByteLedger() as ledger, C.count_torch_distributed():
        ddp(torch.randn(4, 13) + dist.get_rank()).sum().backward()
    # the counting hook must not change what DDP computes: gradients are averaged across ranks
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grads)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert all(torch.equal(a, b) for a, b in zip(reference, model.parameters()))
    return numel, ledger.total(source="torch.distributed"), ledger.volume()


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_step_counted_from_outside(world):
    for numel, counted, volume in run_distributed(_ddp_step_counted_from_outside, world, timeout=90):
        assert counted == numel * FP32  # one all-reduce of every gradient
        assert volume == 2 * numel * FP32  # = 2 Psi, the formula DDP is held to


def _torch_distributed_calls_counted() -> tuple[int, int]:
    world = dist.get_world_size()
    with C.ByteLedger() as ledger, C.count_torch_distributed():
        out = torch.empty(world * 6)
        dist.all_gather_single(out, torch.ones(6))
        dist.reduce_scatter_single(torch.empty(6), torch.ones(world * 6))
        dist.all_reduce(torch.ones(5))
        C.all_reduce(torch.ones(2))  # plait's own call: counted once, as "plait"
    assert dist.all_reduce.__name__ == "all_reduce" and not hasattr(dist.all_reduce, "__plait_counting__")
    return ledger.total(source="torch.distributed"), ledger.total(source="plait")


def test_raw_torch_distributed_calls_are_counted_and_restored():
    for peer, ours in run_distributed(_torch_distributed_calls_counted, 2, timeout=90):
        assert peer == (2 * 6 + 2 * 6 + 5) * FP32
        assert ours == 2 * FP32


def _fsdp2_step_counted() -> tuple[int, dict]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    numel = sum(p.numel() for p in model.parameters())
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with C.ByteLedger() as ledger, C.count_torch_distributed():
        model(torch.randn(2, 16)).sum().backward()
    return numel, ledger.by_op()


def test_fsdp2_collectives_are_counted():
    for numel, by_op in run_distributed(_fsdp2_step_counted, 2, timeout=120):
        # forward all-gather + backward re-gather + gradient reduce-scatter: the 3 Psi of ZeRO-3
        assert by_op.get("all_gather", 0) == 2 * numel * FP32
        assert by_op.get("reduce_scatter", 0) == numel * FP32


def test_ledger_is_empty_without_collectives_and_filters():
    with C.ByteLedger() as ledger:
        pass
    assert ledger.total() == 0 and ledger.by_op() == {} and ledger.volume() == 0


def _scratch_reduce_scatter() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    out = {}
    for n in (5, 4099):
        full = torch.randn(world * n) * 1e3
        want = torch.empty(n)
        C.reduce_scatter_tensor(want, full.clone())
        got, blocking = torch.empty(n), torch.empty(n)
        scratch = full.clone()
        with C.ByteLedger() as ledger:
            work = C.reduce_scatter_tensor(got, scratch, async_op=True, input_is_scratch=True)
            work.wait()
            C.reduce_scatter_tensor(blocking, full.clone(), input_is_scratch=True)
        out[n] = {"equal": torch.equal(got, want) and torch.equal(blocking, want),
                  "overwritten": not torch.equal(scratch, full), "by_op": ledger.by_op()}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_of_a_scratch_input_is_bitwise_the_same(world):
    """gloo reduces a scratch input in place (no copy of it) and keeps the same result bit for bit;
    the ledger still counts a reduce-scatter of the input."""
    for got in run_distributed(_scratch_reduce_scatter, world, timeout=90):
        for n, r in got.items():
            assert r["equal"] and r["overwritten"], (n, r)
            assert r["by_op"] == {"reduce_scatter": 2 * world * n * FP32}, (n, r)
