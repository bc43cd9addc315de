"""The HF Trainer's DeepSpeed route on plait: ``TrainingArguments(deepspeed=ds_config)`` trained by plait's ZeRO.

A DeepSpeed user's Trainer script passes its ``ds_config.json`` as ``--deepspeed ds.json`` (through
``HfArgumentParser``) or ``TrainingArguments(deepspeed=...)``. Run under
``python -m plait.transformers.launch`` (or ``torchrun ... -m plait.transformers.launch``), the
script is not edited: :func:`deepspeed_intercepted` takes the config off ``TrainingArguments``
before its ``__post_init__`` reaches DeepSpeed (so neither DeepSpeed nor Accelerate's DeepSpeed
plugin is ever set up, and DeepSpeed need not be installed), and keeps it on
``args.plait_deepspeed``; the plait Trainer then translates it with
:func:`plait.zero_sharding.deepspeed.config.translate`:

* ``"auto"`` values are filled from ``TrainingArguments`` and the model config as DeepSpeed's HF
  integration fills them, and a value that contradicts ``TrainingArguments`` is refused as HF
  refuses it (:func:`hf_values`);
* ``gradient_clipping`` is the clipping norm, as under DeepSpeed: absent means no clipping, so
  ``args.max_grad_norm`` is set to 0 then;
* an ``optimizer`` block (AdamW/Adam) is built over every trainable parameter in one group, as
  DeepSpeed builds it under the Trainer (no weight-decay split); a 1-bit block becomes
  ``PlaitConfig.onebit``; a ``scheduler`` block becomes DeepSpeed's schedule
  (:mod:`plait.zero_sharding.deepspeed.schedules`); without them the Trainer's own are used;
* ``sequence_parallel_size`` becomes ``PlaitConfig.sp_size``.

Every key is checked when the Trainer is built, before any work: a key plait does not run is
refused with its dotted path and what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from plait.transformers.config import PlaitConfig
from plait.transformers.onebit import TYPES as ONEBIT_TYPES
from plait.transformers.onebit import onebit_from_deepspeed

#: The ``TrainingArguments`` attribute holding the intercepted DeepSpeed config (dict or JSON path).
ATTRIBUTE = "plait_deepspeed"

# Keys HF fills from TrainingArguments and also checks when written out (its ``fill_match``); the
# others of hf_auto_values are filled only (``fill_only``). Value: the TrainingArguments name.
_MATCHED = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "train_batch_size (world size x micro batch x accumulation)",
    "gradient_clipping": "max_grad_norm", "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1+adam_beta2", "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay", "scheduler.params.warmup_max_lr": "learning_rate",
    "fp16.enabled": "fp16", "bf16.enabled": "bf16",
    "scheduler.params.total_num_steps": "the Trainer's number of training steps",
    "scheduler.params.warmup_num_steps": "warmup_steps",
}


def _get(tree: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _hidden_size(model: Any) -> int | None:
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        if getattr(source, "hidden_size", None) is not None:
            return int(source.hidden_size)
        if getattr(source, "hidden_sizes", None):
            return int(max(source.hidden_sizes))
    return None


def hf_values(tree: dict[str, Any], args: Any, *, world_size: int, model: Any = None,
              num_training_steps: int | None = None) -> dict[str, Any]:
    """The ``auto`` values for ``tree`` (by dotted path), after HF's consistency check.

    Args:
        tree: the loaded ``ds_config``.
        args: the ``TrainingArguments``.
        world_size: data-parallel ranks.
        model: the model (its config's ``hidden_size`` fills the bucket/threshold keys).
        num_training_steps: the Trainer's optimizer steps; ``None`` (when the Trainer is built)
            fills the scheduler's step counts with a stand-in and skips their check.

    Returns:
        ``{dotted path: value}`` for :func:`~plait.zero_sharding.deepspeed.config.translate`'s ``auto=``.

    Raises:
        ValueError: a written value differs from its ``TrainingArguments`` source (every one
            named), as the Trainer's DeepSpeed route refuses it.
    """
    from plait.zero_sharding.deepspeed.config import hf_auto_values

    steps = num_training_steps if num_training_steps is not None else max(int(args.max_steps), 1)
    values = hf_auto_values(args, world_size=world_size, hidden_size=_hidden_size(model), num_training_steps=steps)
    mismatches = []
    later = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
    for path, source in _MATCHED.items():
        if num_training_steps is None and path in later:
            continue
        written = _get(tree, path)
        if written is None or written == "auto" or path not in values:
            continue
        expected = values[path]
        same = list(written) == list(expected) if isinstance(expected, list) else written == expected
        if not same:
            mismatches.append(f"{path}={written!r} vs TrainingArguments {source}={expected!r}")
    if mismatches:
        raise ValueError("the DeepSpeed config contradicts TrainingArguments (as under DeepSpeed, the Trainer's "
                         "value must match):\n  " + "\n  ".join(mismatches) +
                         "\nset these keys to \"auto\" or change the TrainingArguments.")
    return values


def clip_norm(tree: dict[str, Any], args: Any) -> float:
    """The clipping norm DeepSpeed applies: ``gradient_clipping`` (``"auto"``: ``args.max_grad_norm``), 0 if absent."""
    value = tree.get("gradient_clipping")
    if value == "auto":
        return float(args.max_grad_norm or 0.0)
    return float(value or 0.0)


def plan_for(source: Any, args: Any, *, world_size: int, model: Any = None,
             num_training_steps: int | None = None) -> tuple[PlaitConfig, Any]:
    """Translate the intercepted DeepSpeed config into the plait Trainer's settings.

    Args:
        source: the ``ds_config`` dict or JSON path (``args.plait_deepspeed``).
        args, world_size, model, num_training_steps: see :func:`hf_values`.

    Returns:
        ``(PlaitConfig, DeepSpeedPlan)``: the config the Trainer runs, and the translated plan
        (its ``optimizer`` and ``scheduler`` blocks are built by the Trainer).

    Raises:
        ValueError: every refused key by its dotted path, contradictions with ``TrainingArguments``.
    """
    from plait.zero_sharding.deepspeed.config import load_config, translate

    tree = load_config(source)
    onebit = None
    block = tree.get("optimizer") or {}
    if str(block.get("type", "")).lower() in {name.lower() for name in ONEBIT_TYPES}:
        onebit = onebit_from_deepspeed(tree.pop("optimizer"), "DeepSpeed config optimizer")
    plan = translate(tree, world_size=world_size,
                     auto=hf_values(tree, args, world_size=world_size, model=model,
                                    num_training_steps=num_training_steps))
    unknown = sorted(set(plan.extensions) - {"offload"})
    if unknown:
        raise ValueError(f"the DeepSpeed config's {unknown} settings are not run by the HF Trainer "
                         "route yet; remove them, or use plait's own config (PLAIT_CONFIG) for them.")
    # Precision comes from TrainingArguments (bf16/fp16 matched above); the Trainer clips with
    # args.max_grad_norm, which the interception set to the config's gradient_clipping.
    zero = dataclasses.replace(plan.zero, compute_dtype=torch.float32, max_grad_norm=None)
    config = PlaitConfig(zero=zero, sp_size=plan.sequence_parallel_size, onebit=onebit,
                         offload=plan.extensions.get("offload"))
    return config, plan


def optimizer_for(plan: Any, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """The config's AdamW/Adam over every trainable parameter in one group, as DeepSpeed builds it
    under the Trainer; ``None`` without an ``optimizer`` block (the Trainer builds its own)."""
    if plan.optimizer is None:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return plan.optimizer.cls(params, **plan.optimizer.kwargs)


def _intercept(original: Any) -> Any:
    def post_init(self: Any) -> None:
        source = getattr(self, "deepspeed", None)
        if source:
            from plait.zero_sharding.deepspeed.config import load_config

            tree = load_config(source)  # a missing or malformed file is refused here, named
            # The DeepSpeed route of TrainingArguments is never entered: no HfTrainerDeepSpeedConfig,
            # no DeepSpeedPlugin, no Accelerate DeepSpeed state.
            self.deepspeed = None
            setattr(self, ATTRIBUTE, tree)
            clip = clip_norm(tree, self)
            if isinstance(tree.get("gradient_clipping"), int | float) and self.max_grad_norm != clip:
                raise ValueError(f"the DeepSpeed config's gradient_clipping={clip} contradicts TrainingArguments "
                                 f"max_grad_norm={self.max_grad_norm}; set gradient_clipping to \"auto\".")
            self.max_grad_norm = clip
        elif not hasattr(self, ATTRIBUTE):
            setattr(self, ATTRIBUTE, None)
        original(self)

    post_init.__wrapped__ = original  # type: ignore[attr-defined]
    return post_init


@contextlib.contextmanager
def deepspeed_intercepted() -> Iterator[None]:
    """Inside, ``TrainingArguments(deepspeed=...)`` (and subclasses') hands its config to plait.

    The config is loaded (JSON path or dict), moved to ``args.plait_deepspeed``, ``args.deepspeed``
    is set to ``None`` and ``args.max_grad_norm`` to the config's clipping norm, all before the
    original ``__post_init__`` runs. Undone on exit.
    """
    from transformers import TrainingArguments

    original = TrainingArguments.__post_init__
    TrainingArguments.__post_init__ = _intercept(original)
    try:
        yield
    finally:
        TrainingArguments.__post_init__ = original
