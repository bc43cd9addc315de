"""engine.load_checkpoint resumes a checkpoint written by DeepSpeed 0.19.8 itself (ZeRO 1/2/3, fp32 and bf16,
W=1 gloo, and one written at W=2 resumed at W=1): the next losses equal DeepSpeed continuing the same
checkpoint, with its step, scheduler and client state.

fp16 (ZeRO-2 and ZeRO-3, dynamic loss scale with overflows and growths before the save): DeepSpeed
refuses fp16 on a CPU whose oneDNN lacks fp16 kernels (its engine checks
``get_accelerator().is_fp16_supported()``); only that check is lifted, on DeepSpeed's CPU accelerator
class, and its fp16 ZeRO paths then run as written (fp16 weights and gradients, fp32 masters, overflow
checks, dynamic scaling). The loss scaler carries over: scale, skipped steps, hysteresis and the good
steps towards the next growth.
"""

import json
import os
import pathlib
import socket
import subprocess
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

JOB = pathlib.Path(__file__).resolve().parent / "deepspeed_resume_job.py"
sys.path.insert(0, str(JOB.parent))
try:
    from deepspeed_resume_job import allow_fp16_on_cpu, batch, config, net
finally:
    sys.path.remove(str(JOB.parent))


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


def _train_in(engine, steps: int, seed: int, dtype: torch.dtype) -> list[float]:
    generator, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=generator).to(dtype), torch.randint(0, 3, (4,), generator=generator)
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_bf16_deepspeed_checkpoint_bitwise(stage: int, tmp_path) -> None:
    config = {**_config(stage), "bf16": {"enabled": True}}
    net = _net()
    theirs, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    _train_in(theirs, 3, 1, torch.bfloat16)
    theirs.save_checkpoint(str(tmp_path))
    expected = _train_in(theirs, 4, 2, torch.bfloat16)
    net = _net()
    ours, *_ = initialize(model=net, model_parameters=net.parameters(), config=config)
    ours.load_checkpoint(str(tmp_path))
    assert ours.global_steps == 3
    assert _train_in(ours, 4, 2, torch.bfloat16) == expected


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The W=2 DeepSpeed runs that the resumes at W=1 below continue, at every stage and dtype they use.
TWO_RANK_RUNS = ("2:fp32", "3:fp32", "2:fp16", "3:fp16")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> pathlib.Path:
    """Every W=2 DeepSpeed run of ``TWO_RANK_RUNS`` in one torchrun launch (deepspeed_resume_job.py);
    returns the folder that holds ``<stage>-<dtype>/`` for each."""
    out = tmp_path_factory.mktemp("deepspeed-w2")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(_port()), str(JOB), str(out), *TWO_RANK_RUNS],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_two_rank_deepspeed_checkpoint_at_one_rank(stage: int, two_rank_runs: pathlib.Path) -> None:
    """DeepSpeed trains at W=2 (4 samples a rank) and continues; plait resumes its checkpoint at W=1
    with the same 8 samples a step: each loss is the mean of DeepSpeed's two ranks' losses."""
    folder = two_rank_runs / f"{stage}-fp32"
    theirs = [json.loads((folder / f"losses.rank{rank}.json").read_text()) for rank in (0, 1)]
    model = net()
    ours, *_ = initialize(model=model, model_parameters=model.parameters(), config=config(stage, "fp32", 8))
    ours.load_checkpoint(str(folder / "ckpt"))
    assert ours.global_steps == 3
    for index, step in enumerate(range(3, 7)):
        (x0, y0), (x1, y1) = batch(step, 0, torch.float32), batch(step, 1, torch.float32)
        loss = F.cross_entropy(ours(torch.cat([x0, x1])), torch.cat([y0, y1]))
        ours.backward(loss)
        ours.step()
        assert loss.item() == pytest.approx((theirs[0][index] + theirs[1][index]) / 2, rel=1e-5), step


@pytest.fixture
def _fp16_on_cpu():
    undo = allow_fp16_on_cpu()
    yield
    undo()


def _step(engine, step: int, ranks: tuple[int, ...]) -> float:
    pieces = [batch(step, rank, torch.float16) for rank in ranks]
    x, y = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
    loss = F.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _their_scaler(engine) -> tuple[float, int]:
    scaler = engine.optimizer.loss_scaler
    return scaler.cur_scale, engine.skipped_steps


def _our_scaler(engine) -> tuple[float, int]:
    scaler = engine.optimizer.scaler
    return scaler.scale, scaler.skipped_steps


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.usefixtures("_fp16_on_cpu")
def test_resume_fp16_deepspeed_checkpoint_continues_as_deepspeed(stage: int, tmp_path) -> None:
    model = net()
    theirs, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, "fp16", 4))
    for step in range(3):
        _step(theirs, step, (0,))
    theirs.save_checkpoint(str(tmp_path))
    saved_scaler = _their_scaler(theirs)
    assert saved_scaler[1] > 0 and saved_scaler[0] != 2.0 ** config(stage, "fp16", 4)["fp16"]["initial_scale_power"]
    expected = [(_step(theirs, step, (0,)), _their_scaler(theirs)) for step in range(3, 7)]

    model = net()
    ours, *_ = initialize(model=model, model_parameters=model.parameters(), config=config(stage, "fp16", 4))
    ours.load_checkpoint(str(tmp_path))
    assert ours.global_steps == 3 and _our_scaler(ours) == saved_scaler
    got = [(_step(ours, step, (0,)), _our_scaler(ours)) for step in range(3, 7)]
    for (loss, scaler), (their_loss, their_scaler) in zip(got, expected, strict=True):
        assert loss == pytest.approx(their_loss, rel=1e-5)
        assert scaler == their_scaler


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.usefixtures("_fp16_on_cpu")
def test_resume_two_rank_fp16_deepspeed_checkpoint_at_one_rank(stage: int, two_rank_runs: pathlib.Path) -> None:
    """DeepSpeed trains fp16 at W=2 (4 samples a rank); plait resumes at W=1 on the same 8 samples a step,
    with DeepSpeed's scaler state: the next three losses are the mean of DeepSpeed's two ranks' losses
    within 5e-5 and the scaler goes as DeepSpeed's through the first two steps (a growth among them).

    Not 1e-5: DeepSpeed rounds each rank's gradient sum to fp16 and all-reduces in fp16, plait at W=1
    rounds the 8-sample sum once, which moves the loss by about 2e-5 after two updates. Not further:
    whether a step overflows is decided on fp16 gradients, so it depends on how the batch is split
    (DeepSpeed's step 5 overflows in one rank's 4-sample gradients, plait's 8-sample ones do not)."""
    folder = two_rank_runs / f"{stage}-fp16"
    theirs = [json.loads((folder / f"losses.rank{rank}.json").read_text()) for rank in (0, 1)]
    scalers = json.loads((folder / "scaler.json").read_text())
    assert scalers[0][1] > 0 and scalers[2][0] > scalers[1][0]  # overflows before the save, a growth after
    model = net()
    ours, *_ = initialize(model=model, model_parameters=model.parameters(), config=config(stage, "fp16", 8))
    ours.load_checkpoint(str(folder / "ckpt"))
    assert ours.global_steps == 3 and list(_our_scaler(ours)) == scalers[0]
    for index, step in enumerate(range(3, 6)):
        loss = _step(ours, step, (0, 1))
        assert loss == pytest.approx((theirs[0][index] + theirs[1][index]) / 2, rel=5e-5), step
        if index < 2:
            assert list(_our_scaler(ours)) == scalers[index + 1], step
