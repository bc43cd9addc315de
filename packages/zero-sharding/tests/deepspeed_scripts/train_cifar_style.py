"""A training script written for DeepSpeed, in the style of DeepSpeed's cifar example (run unedited on both)."""

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def add_argument():
    parser = argparse.ArgumentParser(description="toy classifier")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--out", required=True, help="where each rank writes its losses")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main():
    cmd_args = add_argument()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = Net()
    model_engine, optimizer, _, _ = deepspeed.initialize(args=cmd_args, model=net, model_parameters=net.parameters())
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1000 + rank)
    micro = model_engine.train_micro_batch_size_per_gpu()
    losses, norms, lrs = [], [], []
    for _ in range(cmd_args.steps * model_engine.gradient_accumulation_steps()):
        inputs = torch.randn(micro, 16, generator=generator)
        labels = torch.randint(0, 4, (micro,), generator=generator)
        loss = F.cross_entropy(model_engine(inputs), labels)
        model_engine.backward(loss)
        boundary = model_engine.is_gradient_accumulation_boundary()
        model_engine.step()
        losses.append(loss.item())
        if boundary:
            norms.append(float(model_engine.get_global_grad_norm()))
            lrs.append(optimizer.param_groups[0]["lr"])
    record = {"losses": losses, "grad_norms": norms, "lrs": lrs, "deepspeed": deepspeed.__name__,
              "engine": type(model_engine).__module__, "global_steps": model_engine.global_steps,
              "train_batch_size": model_engine.train_batch_size(),
              # Under plait, where the ZeRO engine keeps the optimizer state (offload configs: plait-offload-io's).
              "placement": type(getattr(getattr(optimizer, "engine", None), "placement", None)).__name__}
    with open(f"{cmd_args.out}.rank{rank}.json", "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main()
