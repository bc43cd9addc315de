"""torch.distributed.pipelining fixtures: a small language model, its stage splits and training loops.

Two ways torch users build stages, both covered: the traced split (``pipeline(..., split_spec=...)``,
whose stage modules keep the model's global names) and the manual split (torchtitan style: a copy
of the model keeping only this stage's layers, renumbered from 0, so the checkpoint needs
``layer_offset``). The single-process loop runs the same micro-batches and scales the summed
gradients the way ``ScheduleGPipe`` does, so a pipeline run and a single process take the same steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import plait.universal_ckpt as uc

VOCAB, HIDDEN, LAYERS, MICROBATCHES = 32, 16, 4, 2
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    """Embedding, ``LAYERS`` blocks, LM head; a stage sets the parts it does not hold to None."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed: nn.Module | None = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head: nn.Module | None = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (ids, targets) batches of 4 sequences of 6 tokens."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (4, 6), generator=generator), torch.randint(0, VOCAB, (4, 6), generator=generator))
            for _ in range(count)]


def traced_stage(model: TinyLM, rank: int, stages: int):
    """The traced split into ``stages`` equal groups of layers; returns (PipelineStage, name map: None)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    per_stage = LAYERS // stages
    split = {f"layers.{i}": SplitPoint.BEGINNING for i in range(per_stage, LAYERS, per_stage)}
    example = batches(0, 1)[0][0].chunk(MICROBATCHES)[0]
    pipe = pipeline(model, mb_args=(example,), split_spec=split)
    return pipe.build_stage(rank, torch.device("cpu")), None


def manual_stage(model: TinyLM, rank: int, stages: int):
    """This rank's layers kept, renumbered from 0; returns (PipelineStage, name map to global names)."""
    from torch.distributed.pipelining import PipelineStage

    per_stage = LAYERS // stages
    first = rank * per_stage
    model.layers = nn.ModuleList(model.layers[first:first + per_stage])
    if rank > 0:
        model.embed = None
    if rank < stages - 1:
        model.head = None
    stage = PipelineStage(model, rank, stages, torch.device("cpu"))
    return stage, uc.layer_offset("layers.", first)


def pipeline_train(stage, optimizer, data: list, loss=loss_fn) -> list[float]:
    """GPipe over ``MICROBATCHES`` micro-batches per batch; the last stage returns every micro-batch loss."""
    from torch.distributed.pipelining import ScheduleGPipe

    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss)
    out: list[float] = []
    for ids, target in data:
        losses: list[torch.Tensor] = []
        if stage.is_first:
            schedule.step(ids)
        elif stage.is_last:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        out += [loss.item() for loss in losses]
    return out


def single_train(model: nn.Module, optimizer, data: list, loss=loss_fn) -> list[float]:
    """The same steps in one process: micro-batch losses summed in order, gradients divided as GPipe does."""
    out: list[float] = []
    for ids, target in data:
        for mb_ids, mb_target in zip(ids.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            value = loss(model(mb_ids), mb_target)
            value.backward()
            out.append(value.item())
        for param in model.parameters():
            param.grad.div_(MICROBATCHES)
        optimizer.step()
        optimizer.zero_grad()
    return out


def states(module: nn.Module, optimizer, name_map=None) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state under global names (``model.<p>``, ``optim.<field>.<p>``)."""
    rename = name_map or (lambda name: name)
    out = {f"model.{rename(n)}": p.detach().clone() for n, p in module.named_parameters()}
    for name, param in module.named_parameters():
        for field, value in optimizer.state[param].items():
            out[f"optim.{field}.{rename(name)}"] = value.clone()
    return out
