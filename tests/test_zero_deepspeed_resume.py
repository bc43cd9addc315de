"""engine.load_checkpoint resumes a checkpoint written by DeepSpeed 0.19.8 itself (ZeRO 1/2/3, fp32, W=1 gloo):
the next losses equal DeepSpeed continuing the same checkpoint, with its step, scheduler and client state."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pytest.importorskip("plait.universal_ckpt")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")
from plait.zero_sharding.deepspeed import initialize  # noqa: E402


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10**9}


@pytest.fixture(scope="module", autouse=True)
def _group(tmp_path_factory):
    added = [name for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE") if name not in os.environ]
    os.environ.update({name: "1" if name == "WORLD_SIZE" else "0" for name in added})  # DeepSpeed requires them
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo transport; skip the C++ build
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    for name in added:
        os.environ.pop(name, None)
    if created:
        dist.destroy_process_group()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))


def _train(engine, steps: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("stage", "our_stage"), [(1, 1), (2, 2), (3, 3), (2, 3)])
def test_resume_deepspeed_checkpoint_continues_as_deepspeed(stage: int, our_stage: int, tmp_path) -> None:
    net = _net()
    theirs, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=_config(stage))
    _train(theirs, 3, seed=1)
    theirs.save_checkpoint(str(tmp_path), client_state={"epoch": 7, "note": "kept"})
    expected = _train(theirs, 4, seed=2)
    expected_lr = theirs.get_lr()

    files = sorted(os.listdir(tmp_path / "global_step3"))
    net = _net()
    ours, *_ = initialize(model=net, model_parameters=net.parameters(), config=_config(our_stage))
    path, client = ours.load_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "global_step3")
    assert client == {"epoch": 7, "note": "kept"}
    assert ours.global_steps == 3 and ours.lr_scheduler.last_batch_iteration == 2
    assert _train(ours, 4, seed=2) == pytest.approx(expected, rel=1e-5)
    assert ours.get_lr() == pytest.approx(expected_lr, rel=1e-12)
    assert sorted(os.listdir(tmp_path / "global_step3")) == files  # DeepSpeed's files are left as they were
    again, _ = ours.load_checkpoint(str(tmp_path))  # the conversion is reused
    assert again == path
