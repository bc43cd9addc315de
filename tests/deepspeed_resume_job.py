"""Under torchrun with real DeepSpeed (W=2, gloo): train, save a checkpoint, continue; for
``test_zero_deepspeed_resume.py``'s resume at another world size.

Usage: ``deepspeed_resume_job.py OUT_DIR STAGE DTYPE``. Each rank trains 3 steps on its own batches
(seeded by step and rank), saves into ``OUT_DIR/ckpt``, trains 4 more and writes its losses to
``OUT_DIR/losses.rankR.json``.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def config(stage: int, dtype: str, micro: int) -> dict:
    """The config of the resume tests, for ``micro`` samples per rank."""
    out = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9}
    if dtype != "fp32":
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


def main() -> None:
    out, stage, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo transport; skip the C++ build
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    model = net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, dtype, 4))
    losses = []
    for step in range(7):
        if step == 3:
            engine.save_checkpoint(os.path.join(out, "ckpt"))
        x, y = batch(step, rank, DTYPES[dtype])
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with open(os.path.join(out, f"losses.rank{rank}.json"), "w") as handle:
        json.dump(losses[3:], handle)


if __name__ == "__main__":
    main()
