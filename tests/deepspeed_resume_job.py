"""Under torchrun with real DeepSpeed (W=2, gloo): train, save a checkpoint, continue; for
``test_zero_deepspeed_resume.py``'s resume at another world size.

Usage: ``deepspeed_resume_job.py OUT_DIR STAGE:DTYPE [STAGE:DTYPE ...]`` (DTYPE: fp32, bf16 or fp16).
One run per ``STAGE:DTYPE``, one after the other in the same two workers (each launch of torchrun
costs two fresh imports of torch and DeepSpeed), into ``OUT_DIR/<STAGE>-<DTYPE>``: each rank trains
3 steps on its own batches (seeded by step and rank), saves into ``ckpt``, trains 4 more and writes
its losses to ``losses.rankR.json``; rank 0 writes the loss scaler's (scale, skipped steps) at the
save and after each later step to ``scaler.json``. Every run builds its own model and engine from
the same seeds, so a run's figures do not depend on the runs before it.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16 with a dynamic scale that starts too high: the first steps overflow (skipped, hysteresis spent,
# scale backed off), then good steps grow it every 2, so the saved scaler state is far from its start.
# Clipping binds on every step (gradient norms are about 1): DeepSpeed 0.19.8's ZeRO step unscales with
# the scale it has just grown, which halves the gradients of a growth step unless clipping binds, where
# its clip factor cancels that; plait unscales with the scale backward used.
FP16_CLIP = 0.1
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 2,
        "min_loss_scale": 1}


def allow_fp16_on_cpu():
    """Lift DeepSpeed's refusal of fp16 on a CPU without oneDNN fp16 kernels (its only CPU-specific
    check; the fp16 ZeRO paths themselves run unchanged). Returns the function that restores it."""
    from deepspeed.accelerator import get_accelerator

    cls = type(get_accelerator())
    original = cls.is_fp16_supported
    cls.is_fp16_supported = lambda self: True

    def undo() -> None:
        cls.is_fp16_supported = original

    return undo


def config(stage: int, dtype: str, micro: int) -> dict:
    """The config of the resume tests, for ``micro`` samples per rank."""
    out = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9}
    if dtype == "fp16":
        out["fp16"], out["gradient_clipping"] = dict(FP16), FP16_CLIP
    elif dtype != "fp32":
        out[dtype] = {"enabled": True}
    return out


def net() -> nn.Module:
    """The resume tests' model, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))


def batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s 4 samples of step ``step``."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=generator).to(dtype), torch.randint(0, 3, (4,), generator=generator)


def run(out: str, stage: int, dtype: str) -> None:
    """One DeepSpeed run at this world size: train, save after 3 steps, train 4 more; write the figures."""
    rank = int(os.environ["RANK"])
    undo = allow_fp16_on_cpu() if dtype == "fp16" else None
    model = net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, dtype, 4))
    losses, scalers = [], []
    for step in range(7):
        if step == 3:
            engine.save_checkpoint(os.path.join(out, "ckpt"))
        if step >= 3 and dtype == "fp16":
            scalers.append([engine.optimizer.loss_scaler.cur_scale, engine.skipped_steps])
        x, y = batch(step, rank, DTYPES[dtype])
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with open(os.path.join(out, f"losses.rank{rank}.json"), "w") as handle:
        json.dump(losses[3:], handle)
    if dtype == "fp16" and rank == 0:
        scalers.append([engine.optimizer.loss_scaler.cur_scale, engine.skipped_steps])
        with open(os.path.join(out, "scaler.json"), "w") as handle:
            json.dump(scalers, handle)
    if undo is not None:
        undo()


def main() -> None:
    out, runs = sys.argv[1], [arg.split(":") for arg in sys.argv[2:]]
    bad = [":".join(r) for r in runs if len(r) != 2 or not r[0].isdigit() or r[1] not in DTYPES]
    if not runs or bad:
        sys.exit(f"usage: deepspeed_resume_job.py OUT_DIR STAGE:DTYPE [...]; DTYPE one of {sorted(DTYPES)}; got {bad}")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo transport; skip the C++ build
    deepspeed.init_distributed(dist_backend="gloo")
    for stage, dtype in runs:
        folder = os.path.join(out, f"{stage}-{dtype}")
        os.makedirs(folder, exist_ok=True)
        run(folder, int(stage), dtype)


if __name__ == "__main__":
    main()
