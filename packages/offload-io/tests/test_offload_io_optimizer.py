"""OffloadedOptimizer: bitwise equal to the same optimizer in memory, over N fp32 steps."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.testing import global_batch, tiny_llama
from plait.offload_io import IOConfig, OffloadedOptimizer

STEPS = 5
FAST_IO = IOConfig(block_size=64 << 10, queue_depth=4, workers=2)


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_llama(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=96)


def param_groups(model: torch.nn.Module, lr: float = 3e-3) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]


def train(model, optimizer, steps: int, start: int = 0, *, scheduler=None) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        data = global_batch(step, 2, 16)
        loss = model(data["input_ids"], labels=data["labels"]).loss
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def offloaded(model, tmp_path, **kwargs) -> OffloadedOptimizer:
    if kwargs.get("device") == "nvme":
        kwargs.setdefault("path", str(tmp_path))
        kwargs.setdefault("io", FAST_IO)
    return OffloadedOptimizer(param_groups(model), torch.optim.AdamW, lr=3e-3, sub_group_size=20_000, **kwargs)


def reference(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=3e-3, fused=True)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert entry.keys() == ours["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key], value), (index, key)
    for mine, other in zip(ours["param_groups"], theirs["param_groups"]):
        assert mine == other


@pytest.mark.parametrize(("device", "master_weights"), [("cpu", "auto"), ("nvme", "auto"), ("nvme", "on")])
def test_bitwise_equal_to_in_memory_adamw(tmp_path, device, master_weights):
    ref_model, our_model = small_model(), small_model()
    ref_opt = reference(ref_model)
    our_opt = offloaded(our_model, tmp_path, device=device, master_weights=master_weights)
    assert len(our_opt._subgroups) > 2  # several sub-groups, so state really streams
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    our_sched = torch.optim.lr_scheduler.StepLR(our_opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        assert train(our_model, our_opt, 1, step, scheduler=our_sched) == train(ref_model, ref_opt, 1, step,
                                                                              scheduler=ref_sched)
        assert_same_params(our_model, ref_model)
    assert_same_state(our_opt.state_dict(), ref_opt.state_dict())
    our_opt.close()


def test_nvme_store_holds_less_than_the_state(tmp_path):
    model = small_model()
    opt = offloaded(model, tmp_path, device="nvme")
    train(model, opt, 2)
    state_bytes = sum(2 * p.numel() * 4 for p in model.parameters())
    assert opt.resident_state_bytes < state_bytes
    opt.close()


def test_nvme_keeps_fp32_masters_on_disk_too(tmp_path):
    model = small_model()
    opt = offloaded(model, tmp_path, device="nvme", master_weights="on")
    train(model, opt, 2)
    pairs = [(m, p) for sg in opt._subgroups for m, p in zip(sg.masters, sg.params)]
    assert all(m.untyped_storage().nbytes() <= 4 for m, _ in pairs)  # placeholders between steps
    assert all(m.shape == p.shape for m, p in pairs)
    assert opt.resident_state_bytes - opt.store.resident_bytes <= 4 * len(pairs)  # only the slots hold data
    assert len(opt.store._slots) == 3
    saved = opt.state_dict()["master_weights"]
    in_order = [p for g in opt.param_groups for p in g["params"]]
    assert all(torch.equal(saved[i], p) for i, p in enumerate(in_order))  # fp32 model: master == param
    opt.close()


def test_state_dict_resumes_bitwise_and_loads_into_plain_adamw(tmp_path):
    ref_model = small_model()
    ref_opt = reference(ref_model)
    train(ref_model, ref_opt, 6)

    first_model = small_model()
    first = offloaded(first_model, tmp_path / "a", device="nvme")
    train(first_model, first, 3)
    saved_state, saved_params = first.state_dict(), [p.detach().clone() for p in first_model.parameters()]
    first.close()

    resumed_model = small_model()
    with torch.no_grad():
        for p, s in zip(resumed_model.parameters(), saved_params):
            p.copy_(s)
    resumed = offloaded(resumed_model, tmp_path / "b", device="nvme")
    resumed.load_state_dict(saved_state)
    train(resumed_model, resumed, 3, start=3)
    assert_same_params(resumed_model, ref_model)
    resumed.close()

    plain_model = small_model()
    with torch.no_grad():
        for p, s in zip(plain_model.parameters(), saved_params):
            p.copy_(s)
    plain = reference(plain_model)
    plain.load_state_dict(saved_state)
    train(plain_model, plain, 3, start=3)
    assert_same_params(plain_model, ref_model)


def test_parameters_that_get_gradients_late(tmp_path):
    models = [small_model(), small_model()]
    opts = [reference(models[0]), offloaded(models[1], tmp_path, device="nvme")]
    for model, opt in zip(models, opts):
        model.layers[1].requires_grad_(False)
        train(model, opt, 2)
        model.layers[1].requires_grad_(True)  # new state appears in sub-groups that already have some
        train(model, opt, 2, start=2)
    assert_same_params(models[1], models[0])
    opts[1].close()


def test_sgd_with_momentum_on_disk(tmp_path):
    models = [small_model(), small_model()]
    ref = torch.optim.SGD(models[0].parameters(), lr=0.05, momentum=0.9)
    ours = OffloadedOptimizer(models[1].parameters(), torch.optim.SGD, device="nvme", path=str(tmp_path),
                              sub_group_size=30_000, io=FAST_IO, lr=0.05, momentum=0.9)
    train(models[0], ref, 3)
    train(models[1], ours, 3)
    assert_same_params(models[1], models[0])
    ours.close()


def test_bf16_model_with_fp32_masters_and_grad_hooks(tmp_path):
    model = small_model().to(torch.bfloat16)
    ours = OffloadedOptimizer(model.parameters(), torch.optim.AdamW, device="nvme", path=str(tmp_path),
                              io=FAST_IO, lr=1e-2)
    ref_model = small_model().to(torch.bfloat16)
    masters = [p.detach().float().clone() for p in ref_model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    for step in range(3):
        data = global_batch(step, 2, 16)
        model(data["input_ids"], labels=data["labels"]).loss.backward()
        # the hooks already copied every gradient to the fp32 host masters during backward
        assert all(sg.masters[0].grad is not None for sg in ours._subgroups)
        ours.step()
        ours.zero_grad()
        ref_model(data["input_ids"], labels=data["labels"]).loss.backward()
        for m, p in zip(masters, ref_model.parameters()):
            m.grad = p.grad.float()
        ref.step()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters()):
                p.copy_(m)
                p.grad = None
    assert_same_params(model, ref_model)
    saved = ours.state_dict()["master_weights"]
    assert all(torch.equal(saved[i], m) for i, m in enumerate(masters))
    ours.close()


def test_closure_and_zero_grad_without_none(tmp_path):
    model = small_model()
    opt = offloaded(model, tmp_path, device="cpu", master_weights="on")
    data = global_batch(0, 2, 16)

    def closure():
        opt.zero_grad(set_to_none=False)
        loss = model(data["input_ids"], labels=data["labels"]).loss
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.ndim == 0
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.close()


def test_group_the_store_cannot_take_stays_in_memory_until_flush(tmp_path, monkeypatch):
    # The up-front space check of a (re-)registration fails during the first step: those
    # sub-groups keep their state and masters in memory (off the store's reused slots), the step
    # still completes for every sub-group, and the next flush or step stores them.
    from plait.offload_io import OffloadDiskFullError
    from plait.offload_io import file_store as file_store_mod

    real_check = file_store_mod.probe.check_space

    def no_room(path, planned, *, min_free_bytes, what="write"):
        if what.startswith("optimizer state of group"):
            raise OffloadDiskFullError(28, f"{what}: no room (test)", path=path, nbytes=planned)
        return real_check(path, planned, min_free_bytes=min_free_bytes, what=what)

    ref_model, our_model = small_model(), small_model()
    ref = reference(ref_model)
    ours = offloaded(our_model, tmp_path, device="nvme", master_weights="on")
    train(ref_model, ref, 3)
    monkeypatch.setattr(file_store_mod.probe, "check_space", no_room)
    with pytest.raises(OffloadDiskFullError, match="no room"):
        train(our_model, ours, 1)
    assert ours._held == {sg.id for sg in ours._subgroups}
    monkeypatch.setattr(file_store_mod.probe, "check_space", real_check)
    ours.zero_grad()
    ours.flush()
    assert not ours._held
    train(our_model, ours, 2, start=1)
    assert_same_params(our_model, ref_model)
    assert_same_state(ours.state_dict(), ref.state_dict())
    ours.close()


@pytest.mark.parametrize("master_weights", ["auto", "on"])
def test_twin_flow_ratio_keeps_part_of_the_state_in_place(tmp_path, master_weights):
    ref_model, our_model = small_model(), small_model()
    ref = reference(ref_model)
    ours = offloaded(our_model, tmp_path, device="nvme", master_weights=master_weights, offload_ratio=0.5)
    kept = [sg for sg in ours._subgroups if sg.kept]
    assert kept and len(kept) < len(ours._subgroups)
    for step in range(3):
        train(ref_model, ref, 1, step)
        train(our_model, ours, 1, step)
        assert_same_params(our_model, ref_model)
    assert not any(sg.id in ours.store for sg in kept)  # kept state never touches the store
    assert ours._subgroups[0].id in ours.store
    assert_same_state(ours.state_dict(), ref.state_dict())
    ours.close()


@pytest.mark.parametrize("overlap_io", [True, False])
def test_overlapped_and_synchronous_io_are_bitwise_equal(tmp_path, overlap_io: bool) -> None:
    ours_model, ref_model = small_model(), small_model()
    opt = offloaded(ours_model, tmp_path, device="nvme", overlap_io=overlap_io)
    assert train(ours_model, opt, STEPS) == train(ref_model, reference(ref_model), STEPS)
    assert_same_params(ours_model, ref_model)
    opt.flush()
    opt.close()


def test_backward_starts_reading_the_first_subgroups(tmp_path) -> None:
    """overlap_io: the first gradient of a backward starts the read of the first sub-group the step
    needs, so that read overlaps backward; with overlap_io=False nothing is read before step()."""
    for overlap_io in (True, False):
        model = small_model()
        opt = offloaded(model, tmp_path / str(overlap_io), device="nvme", overlap_io=overlap_io)
        train(model, opt, 2)
        first = opt._subgroups[0].id
        # Push the first group out of the store's slots: get/put every other group.
        for sg in opt._subgroups[1:]:
            opt.store.get(sg.id)
            opt.store.put(sg.id, dirty=False)
        assert opt.store._find(first) is None
        data = global_batch(3, 2, 16)
        model(data["input_ids"], labels=data["labels"]).loss.backward()
        assert (opt.store._find(first) is not None) is overlap_io, overlap_io
        opt.step()
        opt.close()
