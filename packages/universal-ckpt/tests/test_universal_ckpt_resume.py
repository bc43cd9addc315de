"""R4: 2N steps straight equal N steps + save + fresh processes + N steps, bit for bit."""

from __future__ import annotations

import hashlib

import torch

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed
from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig, small_model, train_steps

N = 3


class LossScaleState:
    """A loss-scaler-like stateful whose state changes every step (grows every second step)."""

    def __init__(self) -> None:
        self.scale, self.good_steps = 1024.0, 0

    def update(self) -> None:
        self.good_steps += 1
        if self.good_steps % 2 == 0:
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]


def _digest(engine: ToyZero, model: torch.nn.Module, scaler: LossScaleState) -> str:
    h = hashlib.sha256()
    for tensor in [engine.master, engine.exp_avg, engine.exp_avg_sq, engine.step_count,
                   *model.state_dict().values()]:
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr(scaler.state_dict()).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _run(steps: range, engine: ToyZero, model: torch.nn.Module, scaler: LossScaleState) -> list[float]:
    losses = []
    for step in steps:
        losses += train_steps(model, engine, range(step, step + 1), noise=True)
        scaler.update()
    return losses


def straight(_: str) -> tuple[list[float], str]:
    model = small_model(0)
    torch.manual_seed(100 + engine_rank())
    engine, scaler = ToyZero(model, ToyZeroConfig(stage=3)), LossScaleState()
    losses = _run(range(2 * N), engine, model, scaler)
    return losses, _digest(engine, model, scaler)


def engine_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def first_half(root: str) -> list[float]:
    model = small_model(0)
    torch.manual_seed(100 + engine_rank())
    engine, scaler = ToyZero(model, ToyZeroConfig(stage=3)), LossScaleState()
    losses = _run(range(N), engine, model, scaler)
    uc.save({"zero": engine, "rng": uc.RNGState(), "scaler": scaler, "extra": {"data_position": N}},
            root, step=N, layout=engine.layout())
    return losses


def second_half(root: str) -> tuple[list[float], str]:
    model = small_model(seed=55)
    torch.manual_seed(12345)  # scrambled on purpose: the checkpoint's RNG state must win
    engine, scaler = ToyZero(model, ToyZeroConfig(stage=3)), LossScaleState()
    state = {"zero": engine, "rng": uc.RNGState(), "scaler": scaler, "extra": None}
    uc.load(state, root)
    start = state["extra"]["data_position"]
    losses = _run(range(start, start + N), engine, model, scaler)
    return losses, _digest(engine, model, scaler)


def test_bit_exact_resume(tmp_path):
    root = str(tmp_path)
    reference = run_distributed(straight, 2, root, timeout=90)
    head = run_distributed(first_half, 2, root, timeout=90)
    tail = run_distributed(second_half, 2, root, timeout=90)
    for rank in range(2):
        expected_losses, expected_digest = reference[rank]
        losses = head[rank] + tail[rank][0]
        # Exact float equality: identical loss bits at every step.
        assert losses == expected_losses, (rank, losses, expected_losses)
        assert tail[rank][1] == expected_digest, f"final state differs on rank {rank}"
