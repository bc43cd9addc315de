"""Input checks that run before anything is allocated: optimizer support, cross-rank agreement."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch.distributed as dist
from torch import nn

from plait.zero_sharding.config import ZeroConfig
from plait.zero_sharding.lowbit import is_lowbit
from plait.zero_sharding.whole_tensor import is_whole_tensor

# Optimizers whose update of an element depends only on that element's own gradient and state,
# so a flat slice of a tensor can be updated independently of the rest of it.
ELEMENTWISE_OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Lion", "ASGD", "Rprop",
    "FusedAdam", "DeepSpeedCPUAdam",
})


def check_optimizer(cls: Any, config: ZeroConfig) -> None:
    """Refuse optimizers that are neither elementwise nor declared whole-tensor (an undeclared
    Shampoo, LBFGS...): ZeRO's flat slices would change their update.

    Raises:
        ValueError: naming the optimizer and the fix.
    """
    if not callable(cls):
        raise ValueError(f"optimizer={cls!r} is neither an optimizer class nor an instance; pass e.g. "
                         "torch.optim.AdamW.")
    name = getattr(cls, "__name__", type(cls).__name__)
    if callable(getattr(cls, "compose_with_zero", None)):
        return  # it builds its own reducer and inner optimizer (or refuses), see zero_shard
    if getattr(cls, "owns_gradient_exchange", False):
        # plait-onebit-optim's optimizers. Checked first: elementwise_optimizer=True must not let them
        # through either.
        raise ValueError(
            f"optimizer {name} exchanges its own compressed momentum over the whole model on every rank; it does "
            "not compose with ZeRO sharding yet (any stage). Use it on the plain, unwrapped model (no zero_shard, "
            "no DDP), or use ZeRO with torch.optim.AdamW."
        )
    if name in ELEMENTWISE_OPTIMIZERS or config.elementwise_optimizer or is_whole_tensor(cls):
        return  # whole-tensor optimizers run under plait.zero_sharding.whole_tensor's placement
    if is_lowbit(cls):
        return  # elementwise within a block; shards are padded to whole blocks (plait.zero_sharding.lowbit)
    raise ValueError(
        f"optimizer {name} is not known to be elementwise, and ZeRO updates flat slices of tensors, which is "
        f"exact only for elementwise optimizers ({', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}). Optimizers that "
        "need whole tensors (LAMB's trust ratio, Adafactor's factored moments, Muon, Shampoo) run whole on one "
        f"rank each once declared: give {name} a class attribute whole_tensor = True or call "
        "plait.zero_sharding.register_whole_tensor(cls) (closure-based ones such as LBFGS are not supported); if "
        f"{name} does update each element independently, set ZeroConfig(elementwise_optimizer=True)."
    )


def _layout(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return h.hexdigest()[:16]


def check_same_across_ranks(model: nn.Module, config: ZeroConfig, optimizer_cls: Any, group: Any = None) -> None:
    """Every rank of the sharding group must shard the same model with the same config and optimizer
    (ranks outside it, e.g. other pipeline stages, may hold other models).

    Raises:
        ValueError: on every rank, naming the differing config fields (or the model/optimizer)
            and the ranks that differ.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    mine = {"config": config.fingerprint(), "model": _layout(model),
            "optimizer": getattr(optimizer_cls, "__name__", repr(optimizer_cls))}
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    reference, first = everyone[0], ranks[0]
    problems = []
    for rank, theirs in zip(ranks[1:], everyone[1:]):
        fields = [k for k in reference["config"] if reference["config"][k] != theirs["config"].get(k)]
        for field in fields:
            problems.append(f"ZeroConfig.{field} is {reference['config'][field]} on rank {first} but "
                            f"{theirs['config'][field]} on rank {rank}")
        if theirs["model"] != reference["model"]:
            problems.append(f"rank {rank} has different parameter names/shapes/dtypes than rank {first}")
        if theirs["optimizer"] != reference["optimizer"]:
            problems.append(f"optimizer is {reference['optimizer']} on rank {first} but {theirs['optimizer']} "
                            f"on rank {rank}")
    if problems:
        raise ValueError("zero_shard inputs differ across ranks: " + "; ".join(problems)
                         + ". Build the same model, config and optimizer on every rank.")


def _compiled_autograd_state() -> tuple[bool, bool]:
    """``(flag, engaged)``: ``torch._dynamo.config.compiled_autograd`` is set, and compiled autograd
    is running a backward now (its flag or its ``_enable`` context). Read from ``sys.modules``:
    nothing to import when dynamo was never loaded (then neither can be on)."""
    config = sys.modules.get("torch._dynamo.config")
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    flag = bool(getattr(config, "compiled_autograd", False))
    engaged = module is not None and bool(module.compiled_autograd_enabled or module.in_compiled_autograd_region)
    return flag, engaged


def check_no_compiled_autograd(stage: int, *, running: bool = False) -> None:
    """Refuse torch's compiled autograd, which plait's ZeRO does not support (any stage).

    Why: compiled autograd runs ZeRO's gradient hooks (eagerly: they are compiler-disabled) but
    never the end-of-backward callback they queue, which launches the last reductions, resets the
    per-unit gradient counts and releases the units. The first step is right and every later one
    silently wrong (measured: the third loss differs at stage 2). Compiling the model itself
    (``model.compile()``, or per block) is supported.

    Args:
        stage: the ZeRO stage, for the message.
        running: called from a backward hook: refuse only if compiled autograd runs this backward
            (the flag alone leaves a backward outside any compiled region eager); otherwise
            (``zero_shard``) refuse the flag itself, before anything is sharded.

    Raises:
        RuntimeError: naming the setting and the fix.
    """
    flag, engaged = _compiled_autograd_state()
    if engaged or (flag and not running):
        raise RuntimeError(
            f"plait ZeRO stage {stage} does not run under torch's compiled autograd "
            "(torch._dynamo.config.compiled_autograd = True, or torch._dynamo.compiled_autograd._enable): "
            "compiled autograd skips ZeRO's end-of-backward callback (the last gradient reductions, the "
            "release of gathered units), so gradients would be wrong from the second step on. Set "
            "torch._dynamo.config.compiled_autograd = False; torch.compile of the model (model.compile(), "
            "or each block) works with plait's ZeRO at every stage."
        )
