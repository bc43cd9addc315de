"""A Megatron-style pipeline x tensor-parallel model that DeepSpeed trains and saves on CPU.

``ParallelMLP`` is one pipeline layer holding tensor-parallel shards the way Megatron-DeepSpeed's
blocks do: a replicated LayerNorm, a column-parallel ``dense_h_to_4h`` (weight and bias split on
dim 0), a row-parallel ``dense_4h_to_h`` (weight split on dim 1) and a replicated output bias. The
two collectives are Megatron's: identity forward / all-reduce backward before the column-parallel
layer, all-reduce forward / identity backward after the row-parallel one, so replicated tensors
get equal gradients on every TP rank and stay equal. ``FullMLP`` is the same layer in one process,
with the same names; ``assemble`` concatenates the shards by hand, an oracle independent of the
importer. DeepSpeed names the files ``layer_LL-model_TT-model_states.pt`` (Megatron-DeepSpeed's
3-D layout) and ``zero_pp_rank_D_mp_rank_MM`` with ``MM = stage * tp + TT``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

HIDDEN = 8
TP_GROUP = None  # the slice (tensor-parallel) group, set once the PipelineModule has built its grid
# What a Megatron-DeepSpeed client passes as client_state for ds_to_universal and for plait.
UNIVERSAL_INFO = {
    "universal_checkpoint_version": 0.2,
    "parameter_with_row_parallelism_patterns": [r".*dense_4h_to_h\.weight$"],
    "tp_replicated_parameter_patterns": [r".*norm\.weight$", r".*norm\.bias$", r"^\d+\.bias$"],
}


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=TP_GROUP)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=TP_GROUP)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _full_weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.3

    return {"norm.weight": 1 + draw(HIDDEN), "norm.bias": draw(HIDDEN),
            "dense_h_to_4h.weight": draw(4 * HIDDEN, HIDDEN), "dense_h_to_4h.bias": draw(4 * HIDDEN),
            "dense_4h_to_h.weight": draw(HIDDEN, 4 * HIDDEN), "bias": draw(HIDDEN)}


class FullMLP(torch.nn.Module):
    """One process: the consolidated layer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.dense_h_to_4h = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.dense_4h_to_h = torch.nn.Linear(4 * HIDDEN, HIDDEN, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.load_state_dict(_full_weights(seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(self.norm(x)))) + self.bias


class ParallelMLP(FullMLP):
    """This TP rank's shard of ``FullMLP(seed)``."""

    def __init__(self, seed: int, tp: int) -> None:
        super().__init__(seed)
        rank = dist.get_rank() % tp  # topology axes (pipe, data, model): the model axis is innermost
        with torch.no_grad():
            for module, dim in ((self.dense_h_to_4h, 0), (self.dense_4h_to_h, 1)):
                module.weight = torch.nn.Parameter(module.weight.chunk(tp, dim)[rank].clone())
            self.dense_h_to_4h.bias = torch.nn.Parameter(self.dense_h_to_4h.bias.chunk(tp)[rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.dense_h_to_4h(_CopyToTP.apply(self.norm(x))))
        return x + _ReduceFromTP.apply(self.dense_4h_to_h(hidden)) + self.bias


def full_model(layers: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[FullMLP(seed) for seed in range(layers)])


def assemble(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Consolidated weights from the TP ranks' state dicts of one stage (by hand)."""
    full = {}
    for name, tensor in shards[0].items():
        if name.endswith("dense_h_to_4h.weight") or name.endswith("dense_h_to_4h.bias"):
            full[name] = torch.cat([s[name] for s in shards], 0)
        elif name.endswith("dense_4h_to_h.weight"):
            full[name] = torch.cat([s[name] for s in shards], 1)
        else:
            full[name] = tensor
    return full


def make_3d(root: str, pp: int, tp: int, layers: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Train a pp x tp PipelineModule 2 steps with ZeRO-1 and save; returns (stage, this rank's weights)."""
    global TP_GROUP
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
    model = PipelineModule(layers=[LayerSpec(ParallelMLP, seed, tp) for seed in range(layers)], topology=topology,
                           loss_fn=F.mse_loss, partition_method="uniform")
    TP_GROUP = model._grid.get_slice_parallel_group()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(1)
    batches = iter([(torch.randn(2, HIDDEN, generator=generator), torch.randn(2, HIDDEN, generator=generator))
                    for _ in range(4)])
    for _ in range(2):
        engine.train_batch(batches)
    engine.save_checkpoint(root, tag="step2", client_state={"universal_checkpoint_info": UNIVERSAL_INFO})
    return engine.stage_id, {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
