"""A small ZeRO-like producer of sharded state, for tests and the benchmark.

It implements the ShardedStateful protocol the way a real ZeRO engine does: all parameters are
flattened into one buffer split across ranks with ``even_flat_range``; each rank keeps an fp32
master shard and Adam's ``exp_avg``/``exp_avg_sq`` for its range. Stage 1/2 describe parameters
as full replicated tensors (every rank holds them); stage 3 describes them as the rank's flat
master pieces. The optimizer math is plain Adam written out, so resumed runs are bit-exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from plait.kernels import collectives
from plait.kernels.sharded_state import ShardedTensor, ShardSpec, even_flat_range, flat_overlap
from plait.kernels.testing import global_batch, rank_slice
from plait.universal_ckpt.exchange import Group


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyZeroConfig:
    """Settings of :class:`ToyZero`.

    Attributes:
        stage: 1, 2 or 3 (1 and 2 differ only in gradient handling, which this toy does not model).
        lr: Adam learning rate.
        betas: Adam betas.
        eps: Adam epsilon.
        offload: keep the optimizer shards in a separate CPU allocation (recorded in the layout).
    """

    stage: int = 3
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    offload: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ToyZeroConfig.stage={self.stage} must be 1, 2 or 3.")
        if self.lr <= 0:
            raise ValueError(f"ToyZeroConfig.lr={self.lr} must be > 0.")


class ToyZero:
    """Shards ``module``'s optimizer state (and at stage 3 its parameters) over the ranks.

    Args:
        module: the model; every rank builds it identically.
        config: the settings.
        group: the process group (None: default, or a single process).
    """

    def __init__(self, module: nn.Module, config: ToyZeroConfig, *, group: Any | None = None) -> None:
        self.module, self.config = module, config
        self.group = Group.of(group)
        self.params = list(module.named_parameters())
        self.offsets, total = [], 0
        for _, param in self.params:
            self.offsets.append(total)
            total += param.numel()
        self.total = total
        index = self.group.ranks.index(self.group.rank)
        self.range = even_flat_range(total, index, self.group.world_size)
        flat = self._flat_params()
        self.master = flat[self.range[0]:self.range[1]].clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = torch.zeros((), dtype=torch.int64)

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([param.detach().reshape(-1) for _, param in self.params])

    def checkpoint_layout(self) -> dict:
        """The producer's layout; ``save`` records it in the manifest without being told."""
        return {"zero_stage": self.config.stage, "offload": self.config.offload,
                "mesh": {"dp": self.group.world_size}}

    layout = checkpoint_layout

    def step(self) -> None:
        """Average gradients, update this rank's shard with Adam, refresh the full parameters."""
        grads = torch.cat([param.grad.reshape(-1) for _, param in self.params])
        if self.group.distributed:
            collectives.all_reduce(grads, group=self.group.handle)
            grads /= self.group.world_size
        grad = grads[self.range[0]:self.range[1]]
        self.step_count += 1
        beta1, beta2 = self.config.betas
        t = int(self.step_count)
        self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (self.exp_avg_sq / (1 - beta2 ** t)).sqrt_().add_(self.config.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-self.config.lr / (1 - beta1 ** t))
        self._publish()

    def _publish(self) -> None:
        """All-gather the master shards into the full parameters (ZeRO's parameter refresh)."""
        chunk = -(-self.total // self.group.world_size)
        padded = torch.zeros(chunk, dtype=self.master.dtype)
        padded[:self.master.numel()] = self.master
        if self.group.distributed:
            flat = torch.empty(chunk * self.group.world_size, dtype=self.master.dtype)
            collectives.all_gather_into_tensor(flat, padded, group=self.group.handle)
        else:
            flat = padded
        with torch.no_grad():
            for (_, param), offset in zip(self.params, self.offsets):
                param.copy_(flat[offset:offset + param.numel()].view_as(param))

    def zero_grad(self) -> None:
        """Drop gradients."""
        for _, param in self.params:
            param.grad = None

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """Parameters, moments and the step counter, each piece aliasing live storage."""
        out: dict[str, ShardedTensor] = {}
        everyone = self.group.ranks
        for (name, param), offset in zip(self.params, self.offsets):
            overlap = flat_overlap((offset, offset + param.numel()), self.range)
            if self.config.stage < 3:
                out[name] = ShardedTensor(ShardSpec.full(name, param, replica_ranks=everyone), param.data.view(-1))
            if overlap is None:
                continue
            local = (overlap[0] - offset, overlap[1] - offset)
            views = slice(overlap[0] - self.range[0], overlap[1] - self.range[0])
            pieces = [("exp_avg." + name, "optimizer_state", self.exp_avg[views]),
                      ("exp_avg_sq." + name, "optimizer_state", self.exp_avg_sq[views])]
            if self.config.stage == 3:
                pieces.append((name, "parameter", self.master[views]))
            for full, kind, tensor in pieces:
                spec = ShardSpec(name=full, kind=kind, global_shape=tuple(param.shape), dtype=param.dtype,
                                 flat_range=local, replica_ranks=(self.group.rank,))
                out[full] = ShardedTensor(spec, tensor)
        out["step"] = ShardedTensor(ShardSpec.full("step", self.step_count, kind="other", replica_ranks=everyone),
                                    self.step_count.view(1))
        return out

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """Refresh the derived copy: masters from full parameters (stage 1/2), or the reverse."""
        if self.config.stage < 3:
            self.master.copy_(self._flat_params()[self.range[0]:self.range[1]])
        else:
            self._publish()


def small_model(seed: int = 0) -> nn.Module:
    """A tiny-llama small enough for multi-rank CPU tests (about 40k parameters)."""
    from plait.kernels.testing import tiny_llama

    torch.manual_seed(seed)
    return tiny_llama(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_seq_len=32)


def train_steps(module: nn.Module, engine: ToyZero, steps: range, *, batch: int = 12, seq: int = 16,
                seed: int = 0, noise: bool = False) -> list[float]:
    """Run ``steps`` of training on the shared corpus; returns the global losses (rank-averaged).

    The data of step s depends only on s, so a resumed run sees the same batches. With ``noise``
    the loss is scaled by ``1 + 0.01 * randn()`` so the run depends on the torch RNG, which a
    resume must then restore bit for bit.
    """
    losses = []
    group = engine.group
    for step in steps:
        data = rank_slice(global_batch(step, batch, seq, seed=seed), group.ranks.index(group.rank), group.world_size)
        loss = module(data["input_ids"], data["labels"]).loss
        if noise:
            loss = loss * (1 + 0.01 * torch.randn(()))
        loss.backward()
        engine.step()
        engine.zero_grad()
        value = loss.detach().clone()
        if group.distributed:
            collectives.all_reduce(value, group=group.handle)
            value /= group.world_size
        losses.append(float(value))
    return losses
