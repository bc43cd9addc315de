"""engine.save_checkpoint / load_checkpoint: a resumed run continues exactly, with client state, tags and counters."""

import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pytest.importorskip("plait.universal_ckpt")
from plait.zero_sharding import deepspeed

CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


@pytest.fixture(scope="module", autouse=True)
def _group(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _engine():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                                           config=CONFIG)
    return engine


def _train(engine, steps: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_resume_continues_the_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    straight = _engine()
    expected = _train(straight, 3, seed=1) + _train(straight, 3, seed=2)

    first = _engine()
    _train(first, 3, seed=1)
    assert first.save_checkpoint(tmp_path, client_state={"epoch": 7}) is True
    assert first.load_checkpoint(tmp_path / "missing") == (None, {})

    resumed = _engine()
    path, client = resumed.load_checkpoint(tmp_path)
    assert client == {"epoch": 7} and pathlib.Path(path).parent == tmp_path
    assert (resumed.global_steps, resumed.micro_steps) == (3, 6)
    assert resumed.get_lr() == pytest.approx(first.get_lr(), rel=1e-12)
    assert resumed.lr_scheduler.last_batch_iteration == first.lr_scheduler.last_batch_iteration
    assert _train(resumed, 3, seed=2) == pytest.approx(expected[6:], rel=1e-6)

    tagged_path, _ = _engine().load_checkpoint(tmp_path, tag="global_step3")
    assert tagged_path == path
    with pytest.raises(FileNotFoundError, match="no checkpoint with tag 'epoch9'"):
        _engine().load_checkpoint(tmp_path, tag="epoch9")
    with pytest.raises(ValueError, match="load_optimizer_states=False"):
        _engine().load_checkpoint(tmp_path, load_optimizer_states=False)


def test_zero_init_builds_sharded_and_trains_as_the_plain_build() -> None:
    plain = _train(_engine(), 2, seed=3)
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=CONFIG)
    assert _train(engine, 2, seed=3) == pytest.approx(plain, rel=1e-6)
    with pytest.raises(ValueError, match=r"zero.Init\(module=...\): build the model inside"), \
            deepspeed.zero.Init(module=nn.Linear(2, 2)):
        pass
