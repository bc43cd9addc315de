"""The engine :func:`plait.zero_sharding.deepspeed.initialize` returns: DeepSpeed's engine methods on plait's ZeRO.

Scripts written for DeepSpeed call ``engine(batch)``, ``engine.backward(loss)`` and
``engine.step()`` once per micro batch; the engine keeps DeepSpeed's accumulation rules: the
loss is divided by ``gradient_accumulation_steps`` in ``backward``, gradients of non-boundary
micro batches stay local (``ZeroModule.no_sync``), and at the boundary ``step()`` runs the
optimizer (clipping inside, per ``gradient_clipping``), zeroes the gradients and steps the
scheduler unless an fp16 overflow skipped the step.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.zero_sharding.deepspeed.config import DeepSpeedPlan


class DeepSpeedEngine(nn.Module):
    """A ZeRO-sharded model with DeepSpeed's engine interface.

    Args:
        module: the ``ZeroModule`` (the model after ``zero_shard``).
        optimizer: its ``ZeroOptimizer``.
        lr_scheduler: the scheduler stepped at each boundary, or ``None``.
        plan: the translated DeepSpeed config.
    """

    def __init__(self, module: nn.Module, optimizer: Any, lr_scheduler: Any, plan: DeepSpeedPlan) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.plan = plan
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._sync_context: contextlib.AbstractContextManager[None] | None = None

    @property
    def device(self) -> torch.device:
        """The device the model computes on."""
        for tensor in self.module.parameters():
            return tensor.device
        return torch.device("cpu")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model (gradients of non-boundary micro batches stay local, as in DeepSpeed)."""
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro batch is the last one before an optimizer step."""
        return (self.micro_steps + 1) % self.plan.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps``; communication waits for the boundary.

        Args:
            loss: the micro batch's loss.
            retain_graph: passed to ``torch.autograd.backward``.

        Returns:
            The loss as given (DeepSpeed's return value).
        """
        scaled = loss / self.plan.gradient_accumulation_steps if self.plan.gradient_accumulation_steps > 1 else loss
        context = contextlib.nullcontext() if self.is_gradient_accumulation_boundary() else self.module.no_sync()
        with context:
            scaled.backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """End a micro batch; at the accumulation boundary step the optimizer and the scheduler."""
        if self.is_gradient_accumulation_boundary():
            skipped_before = self.optimizer.skipped_steps
            self.optimizer.step_then_zero_grad()  # step(); zero_grad(), the gradients spent in place
            if self.optimizer.skipped_steps > skipped_before:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.plan.train_batch_size
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        self.optimizer.zero_grad()

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (before clipping), or ``None``."""
        return self.optimizer.last_grad_norm

    def get_lr(self) -> list[float]:
        """Every parameter group's current learning rate."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def train_micro_batch_size_per_gpu(self) -> int:
        """Per-rank batch of one forward/backward."""
        return self.plan.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro batches per optimizer step."""
        return self.plan.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Global batch of one optimizer step."""
        return self.plan.train_batch_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage."""
        return self.plan.zero.stage

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True) -> bool:
        """Save a universal checkpoint under ``save_dir`` (see :mod:`plait.zero_sharding.deepspeed.checkpoint`).

        Args:
            save_dir: the checkpoint root.
            tag: DeepSpeed's tag (default ``global_step<N>``).
            client_state: extra state returned by :meth:`load_checkpoint`.
            save_latest: must be ``True`` (the root's ``latest`` pointer always moves).

        Returns:
            ``True``, as DeepSpeed.

        Raises:
            ValueError: ``save_latest=False``.
        """
        if not save_latest:
            raise ValueError("save_checkpoint(save_latest=False) is not supported: plait's checkpoint root always "
                             "points `latest` at the newest commit; load older ones by tag.")
        from plait.zero_sharding.deepspeed.checkpoint import save_checkpoint

        save_checkpoint(self, save_dir, tag, client_state)
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, **_: Any) -> tuple[str | None, dict[str, Any]]:
        """Resume from a checkpoint saved by :meth:`save_checkpoint`; returns ``(path, client_state)``.

        See :func:`plait.zero_sharding.deepspeed.checkpoint.load_checkpoint` for the arguments.
        """
        from plait.zero_sharding.deepspeed.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)

