"""Lightning's own ``strategy="ddp"`` with a plait 1-bit optimizer from ``configure_optimizers``.

plait's 1-bit optimizers (``plait.onebit_optim.OnebitAdam``, ``OnebitLamb``, ``ZeroOneAdam``) own the
exchange between ranks: they average the gradients themselves during warm-up and, after it,
exchange the *momentum* in 1 bit instead of the gradient. Under DDP, DDP all-reduces every
gradient in backward first, which after warm-up sends the full fp32 gradient the optimizer exists
to avoid and feeds it averaged gradients where the algorithm compresses each rank's own momentum.

:class:`OptimizerOwnsExchange` closes that gap; the script asks for it in its Trainer
(``L.Trainer(strategy="ddp", callbacks=[OptimizerOwnsExchange()])``: installing plait-lightning adds
nothing to a Trainer by itself). At ``on_fit_start`` (after the strategy wrapped the model in DDP
and built the optimizers, before the first backward) it does nothing unless the model is DDP-wrapped
and an optimizer says ``owns_gradient_exchange``; then it registers :func:`local_gradients_hook` as
DDP's communication hook, so DDP communicates nothing in backward and every rank keeps its own
gradient, exactly as the optimizer is used without DDP (the same bits:
``tests/test_onebit_lightning.py``). DDP's parameter broadcast at wrap time and its buffer broadcast
stay.

Checkpoints: Lightning's ``ddp`` writes rank 0's optimizer state only, but a 1-bit optimizer's
error feedback is each rank's own (its ``state_dict`` refuses another rank's). At
``on_save_checkpoint`` the callback gathers every rank's ``"onebit"`` part to rank 0 into the
checkpoint (``checkpoint["plait_onebit_ddp"]``: the worker error is a full-size fp32 buffer per
rank, so the file grows by about 4 bytes per parameter per rank) and at ``on_load_checkpoint``
hands each rank its own, so a resumed run continues bit for bit. Refused there: a save while the
ranks' parameters differ (0/1 Adam between two synchronisations: there is no one model to save),
and a resume at another world size once error feedback exists (it reshards only under plait ZeRO
with universal checkpoints).

Refused at fit start, each naming the fix (what the optimizer cannot do on local gradients): other
optimizers alongside it (DDP's hook is for the whole model), a communication hook of the user's own
(``DDPStrategy(ddp_comm_hook=...)``), ``gradient_clip_val`` (Lightning would clip each rank's
local gradient by its own norm), and fp16 loss scaling (each rank's scaler would see only its own
overflows, and ranks that skip differently would leave the exchange half-joined).
``plait_zero1``/``plait_zero2`` do all of these with the 1-bit optimizers.

Fabric's ``strategy="ddp"`` has no callbacks: the script calls :func:`fabric_owns_exchange` once,
right after ``fabric.setup(model, optimizer)``, which registers the same hook (and refuses fp16
loss scaling, other optimizers and a hook of the user's own, as above). The script then must not
call ``fabric.clip_gradients`` on the local gradients (give the optimizer ``max_grad_norm``, which
clips the exchanged gradient), and ``fabric.save`` under ``ddp`` writes rank 0's optimizer state
only: rank 0's error feedback, which the other ranks' optimizers refuse to load; save a 1-bit
optimizer's state per rank, or use ``plait_zero1``/``plait_zero2``.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects
# (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``) and refuses them as strings.
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

CHECKPOINT_KEY = "plait_onebit_ddp"

_USE_INSTEAD = ("use strategy='plait_zero1' (whole parameters and gradients on every rank, as DDP) or "
                "'plait_zero2', which compose the 1-bit optimizers with ZeRO")


def local_gradients_hook(state: object, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that communicates nothing: the bucket keeps this rank's gradients.

    Args:
        state: unused (DDP passes the state given at registration).
        bucket: the gradient bucket DDP would all-reduce.

    Returns:
        A completed future holding the bucket's own buffer: DDP writes it back unchanged (with a
        hook registered, DDP leaves the division by the world size to the hook, so none happens).
    """
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class OptimizerOwnsExchange(pl.Callback):
    """Keeps DDP from all-reducing gradients that a plait 1-bit optimizer exchanges itself (module
    docstring). Added to every Trainer by plait-lightning's entry point; a no-op otherwise.

    Attributes:
        hooked: the optimizer class names this callback registered the hook for in the last fit
            (empty when it did nothing).
    """

    def __init__(self) -> None:
        self.hooked: tuple[str, ...] = ()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register :func:`local_gradients_hook` on the DDP-wrapped model of a 1-bit optimizer.

        Raises:
            ValueError: a setting the optimizer cannot honour on local gradients (module docstring).
        """
        self.hooked = ()
        model = trainer.strategy.model
        owners = [o for o in trainer.optimizers if getattr(o, "owns_gradient_exchange", False)]
        if not owners or not isinstance(model, DistributedDataParallel):
            return
        names = ", ".join(type(o).__name__ for o in owners)
        check_ddp_settings(trainer, names, others=len(trainer.optimizers) - len(owners))
        model.register_comm_hook(None, local_gradients_hook)
        self.hooked = tuple(type(o).__name__ for o in owners)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Gather every rank's error feedback and counters into the checkpoint rank 0 writes.

        Raises:
            RuntimeError: the ranks' parameters differ (0/1 Adam between synchronisations).
        """
        if not self.hooked or "optimizer_states" not in checkpoint:
            return
        check_replicated(pl_module, self.hooked)
        indices = [i for i, o in enumerate(trainer.optimizers) if getattr(o, "owns_gradient_exchange", False)]
        mine = [checkpoint["optimizer_states"][i].get("onebit") for i in indices]
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if everyone is not None:
            checkpoint[CHECKPOINT_KEY] = {"world": dist.get_world_size(), "indices": indices, "ranks": everyone}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Give this rank's optimizers their own error feedback back (before Lightning loads them).

        Raises:
            ValueError: the checkpoint holds error feedback of another world size.
        """
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None or "optimizer_states" not in checkpoint:
            return
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        if saved["world"] != world:
            if any(ex is not None for part in saved["ranks"][0] if part for ex in part["exchanges"]):
                raise ValueError(
                    f"this checkpoint holds the 1-bit error feedback of {saved['world']} ranks and the run has "
                    f"{world}: Lightning's ddp checkpoint does not reshard it; resume on {saved['world']} devices, "
                    "or train with strategy='plait_zero1'/'plait_zero2', whose universal checkpoints reshard it.")
            return  # no error feedback yet (warm-up): every rank's state is rank 0's
        for index, part in zip(saved["indices"], saved["ranks"][rank]):
            checkpoint["optimizer_states"][index]["onebit"] = part


def fabric_owns_exchange(model: Any, *optimizers: Any) -> tuple[str, ...]:
    """Fabric ``strategy="ddp"``: keep DDP from all-reducing what a 1-bit optimizer exchanges itself.

    Call it once, after ``model, optimizer = fabric.setup(model, optimizer)`` and before the first
    backward (module docstring).

    Args:
        model: the module ``fabric.setup`` returned.
        optimizers: every optimizer ``fabric.setup`` returned for that model.

    Returns:
        The 1-bit optimizers' class names the hook was registered for (empty when the model is not
        DDP-wrapped or no optimizer exchanges itself: then nothing is changed).

    Raises:
        ValueError: fp16 loss scaling, optimizers that need DDP's all-reduce beside the 1-bit one,
            or a communication hook already registered, each naming the fix.
    """
    ddp = getattr(model, "_forward_module", model)
    inner = [getattr(o, "optimizer", o) for o in optimizers]
    owners = [o for o in inner if getattr(o, "owns_gradient_exchange", False)]
    if not owners or not isinstance(ddp, DistributedDataParallel):
        return ()
    names = ", ".join(type(o).__name__ for o in owners)
    if len(owners) != len(inner):
        raise ValueError(f"Fabric ddp with {names} and {len(inner) - len(owners)} other optimizer(s): the 1-bit "
                         "optimizer needs DDP's gradient all-reduce off for the whole model, which the others need; "
                         f"give every parameter to the 1-bit optimizer, or {_USE_INSTEAD}.")
    if getattr(ddp, "_comm_hooks", None):
        raise ValueError(f"Fabric ddp with {names}: this model already has a DDP communication hook; the 1-bit "
                         "optimizer registers its own (DDP takes one), so register none.")
    precision = getattr(getattr(model, "_strategy", None), "precision", None)
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(f"Fabric precision='16-mixed' (fp16 loss scaling) with ddp and {names}: each rank's "
                         "scaler would see only its own overflows; use bf16, or the optimizer's own "
                         f"loss_scaling setting without Fabric's scaler, or {_USE_INSTEAD}.")
    ddp.register_comm_hook(None, local_gradients_hook)
    return tuple(type(o).__name__ for o in owners)


def check_replicated(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Refuse to save a DDP checkpoint (rank 0's weights) while the ranks' parameters differ.

    Compares a float64 sum and sum of squares of every parameter across ranks (one small
    all-gather): equal on every rank of a replicated model, different after a local step.

    Raises:
        RuntimeError: naming the optimizer and the fix.
    """
    # On the parameters' device, so NCCL can gather it as gloo does on CPU.
    prints = torch.stack([torch.stack((p.detach().double().sum(), p.detach().double().square().sum()))
                          for p in module.parameters()]).reshape(-1)
    everyone = [torch.empty_like(prints) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, prints)
    if any(not torch.equal(other, everyone[0]) for other in everyone[1:]):
        raise RuntimeError(
            f"checkpoint with strategy='ddp' and {', '.join(names)}: the ranks' parameters differ (0/1 Adam between "
            "two synchronisations: each rank's copy is its own), so rank 0's weights are not the model; save at a "
            "synchronisation step (every local_step_interval steps) or after the variance phase ends.")


def check_ddp_settings(trainer: pl.Trainer, names: str, *, others: int) -> None:
    """Refuse what a 1-bit optimizer cannot honour under Lightning's DDP (module docstring).

    Args:
        trainer: the Trainer about to fit.
        names: the 1-bit optimizers' class names (for the messages).
        others: how many of the Trainer's optimizers are not 1-bit ones.

    Raises:
        ValueError: naming the setting and the fix.
    """
    if others:
        raise ValueError(
            f"strategy='ddp' with {names} and {others} other optimizer(s): the 1-bit optimizer needs DDP's "
            "gradient all-reduce turned off for the whole model, which the others need; give every parameter to "
            f"the 1-bit optimizer (param groups for different settings), or {_USE_INSTEAD}.")
    if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
        raise ValueError(
            f"strategy='ddp' with {names} and a ddp_comm_hook of your own: the 1-bit optimizer exchanges the "
            "gradients itself and registers DDP's hook; drop DDPStrategy(ddp_comm_hook=...).")
    if trainer.gradient_clip_val:
        raise ValueError(
            f"gradient_clip_val={trainer.gradient_clip_val} with strategy='ddp' and {names}: the gradients are "
            "each rank's own until the optimizer's step, so Lightning would clip them by a local norm; drop "
            "gradient_clip_val and give the optimizer's config max_grad_norm (it clips the exchanged gradient), "
            f"or {_USE_INSTEAD} (there gradient_clip_val clips the averaged gradient).")
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            f"precision={trainer.precision_plugin.precision!r} (fp16 loss scaling) with strategy='ddp' and {names}: "
            "each rank's scaler would see only its own overflows and ranks could skip different steps; "
            f"use bf16, or {_USE_INSTEAD} (fp16 loss scaling with skipped steps agreed by every rank).")
