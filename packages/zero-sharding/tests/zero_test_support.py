"""Shared pieces of the zero-sharding tests: the small model, the single-process reference, a
training loop every rank runs. Imported by the test files (which put this folder on sys.path)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from plait.kernels.testing import global_batch, rank_slice, tiny_llama

MODEL = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300, max_seq_len=64)
BATCH, SEQ, STEPS = 12, 16, 20
OPT = dict(lr=1e-3, weight_decay=0.1)
# Elementwise optimizers the parity tests cover, with options that make each of them move.
OPTIMIZERS = {"AdamW": OPT, "SGD": dict(lr=0.05, momentum=0.9, weight_decay=0.01), "Adagrad": dict(lr=0.01),
              "RMSprop": dict(lr=1e-3, momentum=0.5)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training setup compared against the reference."""

    accumulation: int = 1
    clip: float | None = None
    compute_dtype: torch.dtype = torch.float32
    sync_each_micro: bool = True
    steps: int = STEPS
    optimizer: str = "AdamW"

    def make_optimizer(self, params: object) -> torch.optim.Optimizer:
        return getattr(torch.optim, self.optimizer)(params, **OPTIMIZERS[self.optimizer])


def build_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_llama(**MODEL)


def reference_run(variant: Variant) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, whole global batch, fp32 masters (mixed precision done by hand, as ZeRO does)."""
    model = build_model()
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    model.to(variant.compute_dtype)
    optimizer = variant.make_optimizer(masters)
    losses = []
    for step in range(variant.steps):
        batch = global_batch(step, BATCH, SEQ)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
            p.grad = None
        if variant.clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, variant.clip)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: m.detach().clone() for n, m in zip(names, masters)}


def train_ranks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, variant: Variant) -> list[float]:
    """The user's loop on every rank; returns the global loss per step (mean over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(variant.steps):
        local = rank_slice(global_batch(step, BATCH, SEQ), rank, world)
        micro = BATCH // world // variant.accumulation
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(variant.accumulation):
            part = {k: v[m * micro:(m + 1) * micro] for k, v in local.items()}
            last = m == variant.accumulation - 1
            if variant.sync_each_micro or last:
                loss = model(**part).loss / variant.accumulation
                loss.backward()
            else:
                with model.no_sync():
                    loss = model(**part).loss / variant.accumulation
                    loss.backward()
            total += loss.detach().double()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def train_stage3_logged(gatherer: object = None, reducer: object = None, *, steps: int = 8, batch: int = 8,
                        seq: int = 16, lr: float = 3e-3) -> tuple[list[float], object]:
    """ZeRO-3 (every parameter sharded, fp32 reduction) with the given policies over ``steps`` steps
    (batches repeat every 4); returns the mean loss per step and the byte ledger of the whole run."""
    from plait.kernels.collectives import ByteLedger
    from plait.zero_sharding import ZeroConfig, zero_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    config = ZeroConfig(stage=3, param_persistence_threshold=0, reduce_dtype=torch.float32)
    model, optimizer = zero_shard(build_model(seed=0), torch.optim.AdamW, config, gatherer=gatherer,
                                  reducer=reducer, lr=lr, weight_decay=0.0)
    losses = []
    with ByteLedger() as ledger:
        for step in range(steps):
            loss = model(**rank_slice(global_batch(step % 4, batch, seq), rank, world)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().double().reshape(1)
            dist.all_reduce(total)  # torch.distributed directly: reporting, not counted by the ledger
            losses.append(total.item() / world)
    return losses, ledger
