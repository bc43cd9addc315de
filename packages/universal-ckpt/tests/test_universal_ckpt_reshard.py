"""Save on one layout, load on another (R5), plus plain, DDP and optimizer round trips."""

from __future__ import annotations

import torch
from torch import nn

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig, small_model, train_steps

STEPS = 3


def _consolidated(path) -> dict[str, torch.Tensor]:
    ckpt = uc.latest(path)
    manifest = uc.read_manifest(ckpt)
    return {name: uc.read_full(ckpt, manifest, entry) for name, entry in manifest.tensors.items()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


def save_toy(root: str, stage: int) -> list[float]:
    model = small_model(0)
    engine = ToyZero(model, ToyZeroConfig(stage=stage))
    losses = train_steps(model, engine, range(STEPS))
    uc.save({"zero": engine, "extra": {"data_position": STEPS}}, root, step=STEPS)  # layout from the producer
    return losses


def load_resave_continue(src: str, dst: str, stage: int, more: int) -> list[float]:
    model = small_model(seed=123)  # a different init: the load must overwrite everything
    engine = ToyZero(model, ToyZeroConfig(stage=stage))
    state = {"zero": engine, "extra": None}
    manifest = uc.load(state, src)
    assert state["extra"] == {"data_position": STEPS}
    uc.save({"zero": engine, "extra": state["extra"]}, dst, step=manifest.step, layout=engine.layout())
    return train_steps(model, engine, range(manifest.step, manifest.step + more))


def test_reshard_4_to_3_2_1(tmp_path):
    src = str(tmp_path / "w4")
    run_distributed(save_toy, 4, src, 3, timeout=120)
    reference = _consolidated(src)
    manifest = uc.read_manifest(uc.latest(src))
    assert manifest.layout.world_size == 4 and manifest.layout.zero_stage == 3
    assert {e.kind for e in manifest.tensors.values()} == {"parameter", "optimizer_state", "other"}
    continued = {}
    for world in (3, 2, 1):
        dst = str(tmp_path / f"w{world}")
        continued[world] = run_distributed(load_resave_continue, world, src, dst, 3, 2, timeout=120)[0]
        _assert_bitwise(_consolidated(dst), reference)
    # Continued training matches across layouts (only the gradient all-reduce order differs).
    for world in (3, 2):
        torch.testing.assert_close(torch.tensor(continued[world]), torch.tensor(continued[1]), rtol=1e-5, atol=1e-6)


def test_reshard_1_to_4_and_stage_change(tmp_path):
    src = str(tmp_path / "w1")
    run_distributed(save_toy, 1, src, 3, timeout=60)
    reference = _consolidated(src)
    run_distributed(load_resave_continue, 4, src, str(tmp_path / "w4"), 3, 1, timeout=120)
    _assert_bitwise(_consolidated(tmp_path / "w4"), reference)
    # ZeRO-3 at world 1 -> ZeRO-1 at world 2 (parameters become replicated full tensors).
    run_distributed(load_resave_continue, 2, src, str(tmp_path / "s1"), 1, 1, timeout=120)
    stage1 = uc.read_manifest(uc.latest(tmp_path / "s1"))
    assert stage1.layout.zero_stage == 1
    assert all(len(e.pieces) == 1 for e in stage1.tensors.values() if e.kind == "parameter")
    _assert_bitwise(_consolidated(tmp_path / "s1"), reference)


def _plain_training(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def test_plain_module_optimizer_scheduler_roundtrip(tmp_path):
    model, optim, sched = _plain_training(0)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    uc.save({"model": model, "optim": optim, "sched": sched, "extra": {"epoch": 1}}, tmp_path, step=3)
    model2, optim2, sched2 = _plain_training(1)  # fresh optimizer: no state yet
    state = {"model": model2, "optim": optim2, "sched": sched2, "extra": None}
    uc.load(state, tmp_path)
    _assert_bitwise(model.state_dict(), model2.state_dict())
    a, b = optim.state_dict(), optim2.state_dict()
    for index in a["state"]:
        _assert_bitwise(a["state"][index], b["state"][index])
    assert a["param_groups"] == b["param_groups"]
    assert sched.state_dict() == sched2.state_dict() and state["extra"] == {"epoch": 1}


def ddp_save(root: str) -> None:
    model, optim, _ = _plain_training(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(4, 6)).square().mean().backward()
    optim.step()
    uc.save({"model": ddp, "optim": optim}, root, step=1)


def test_ddp_save_loads_into_single_process(tmp_path):
    run_distributed(ddp_save, 2, str(tmp_path), timeout=60)
    manifest = uc.read_manifest(uc.latest(tmp_path))
    # Replicated state is written once, by rank 0.
    assert set(manifest.files) == {"data/rank-00000.bin"}
    model, optim, _ = _plain_training(7)
    uc.load({"model": model, "optim": optim}, tmp_path)
    saved = _consolidated(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(saved[f"model/{name}"], tensor)


def test_keep_last_and_latest(tmp_path):
    tensor = torch.arange(10.0)
    for step in range(5):
        tensor += 1
        uc.save({"t": tensor}, tmp_path, step=step, keep_last=2)
    assert [p.name for p in sorted(tmp_path.glob("step-*"))] == ["step-0000000003", "step-0000000004"]
    assert uc.latest(tmp_path).name == "step-0000000004"
    target = torch.zeros(10)
    assert uc.load({"t": target}, tmp_path).step == 4
    assert torch.equal(target, tensor)
    manager = uc.CheckpointManager(uc.CheckpointConfig(root=tmp_path, keep_last=1))
    manager.save({"t": tensor}, step=9)
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-0000000009"]
    assert manager.restore({"t": torch.zeros(10)}) == 9


def test_non_contiguous_targets_are_written_back(tmp_path):
    source = torch.arange(12.0).reshape(3, 4).t()  # a transposed (non-contiguous) view
    module = nn.Module()
    module.register_buffer("table", torch.randn(5, 2).t())
    uc.save({"x": source, "m": module}, tmp_path, step=0)
    target, other = torch.zeros(3, 4).t(), nn.Module()
    other.register_buffer("table", torch.zeros(5, 2).t())
    uc.load({"x": target, "m": other}, tmp_path)
    assert torch.equal(target, source) and torch.equal(other.table, module.table)


def bytes_read_by_rank(src: str, verify: bool) -> tuple[int, int, int]:
    """Load a world-1 checkpoint at world 4, counting the bytes this rank reads from data files."""
    from plait.universal_ckpt import reader

    counted = []
    original = reader.read_verified

    def counting(*args, **kwargs):
        data = original(*args, **kwargs)
        counted.append(kwargs["stop"] - kwargs["start"] if kwargs["hashes"] is None else len(data))
        return data

    reader.read_verified = counting
    try:
        engine = ToyZero(small_model(9), ToyZeroConfig(stage=3))
        uc.load({"zero": engine}, src, verify=verify)
    finally:
        reader.read_verified = original
    share = sum(p.local.numel() * p.local.element_size() for p in engine.sharded_state_dict().values())
    return sum(counted), share, torch.distributed.get_rank()


def test_each_rank_reads_only_its_byte_ranges(tmp_path):
    run_distributed(save_toy, 1, str(tmp_path), 3, timeout=60)
    total = sum(uc.read_manifest(uc.latest(tmp_path)).files.values())
    for read, share, rank in run_distributed(bytes_read_by_rank, 4, str(tmp_path), False, timeout=90):
        assert read == share, (rank, read, share)  # exactly its own elements, nothing else
        assert read < total / 3
