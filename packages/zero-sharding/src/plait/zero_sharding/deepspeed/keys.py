"""The registry of every ``ds_config`` key and what plait does with it.

Each :class:`Key` is one of three actions: ``mapped`` (the value sets a plait setting),
``accepted`` (read and checked, but it changes nothing in plait; the reason says why) or
``refused`` (the translator raises before any work, saying what to do). A ``check`` can refuse
some values of an accepted or mapped key (e.g. ``prescale_gradients: true``). Keys of other
packages (plait-offload-io's offload and ``aio`` keys) are added by those packages through the
``plait.deepspeed_keys`` entry point (:func:`load_package_keys` calls :func:`register_keys` and
:func:`register_extension` there), so this module never imports them. The README's key table is
generated from this registry (:func:`key_table_markdown`) and a test keeps the two in sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

ACTIONS = ("mapped", "accepted", "refused")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Key:
    """One ``ds_config`` key (dotted path; a ``*`` segment stands for any key at that level).

    Attributes:
        path: e.g. ``"zero_optimization.stage"`` or ``"tensorboard.*"``.
        action: ``"mapped"``, ``"accepted"`` or ``"refused"``.
        effect: for the README and error messages: the plait setting it maps to, the reason it
            changes nothing, or what to do instead.
        check: for mapped/accepted keys: returns a refusal message for values plait cannot
            honour (``None`` when the value is fine).
        owner: the distribution that registered the key.
    """

    path: str
    action: str
    effect: str
    check: Callable[[Any], str | None] | None = None
    owner: str = "plait-zero-sharding"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Key({self.path!r}).action={self.action!r}; use one of {ACTIONS}.")


KEYS: dict[str, Key] = {}
#: extension name -> builder(whole ds_config) -> value or ``None``; e.g. plait-offload-io's ``"offload"``.
EXTENSIONS: dict[str, Callable[[dict[str, Any]], Any]] = {}
#: The entry-point group through which other distributions register their keys (each entry point is
#: a function of no arguments that calls :func:`register_keys` / :func:`register_extension`).
ENTRY_POINT_GROUP = "plait.deepspeed_keys"
_loaded: list[str] = []


def register_keys(keys: Iterable[Key]) -> None:
    """Add keys to the registry (called by packages that own a ``ds_config`` section).

    Args:
        keys: the keys; a path registered before is replaced (a package refines a placeholder).

    Raises:
        ValueError: a key with an unknown action.
    """
    for key in keys:
        KEYS[key.path] = key


def register_extension(name: str, builder: Callable[[dict[str, Any]], Any]) -> None:
    """Add a builder whose value lands in ``DeepSpeedPlan.extensions[name]`` (``None``: absent).

    Args:
        name: the extension's name (``"offload"`` is read by every DeepSpeed route).
        builder: called with the whole ``ds_config`` after its keys are checked; raises
            ``ValueError`` naming the key for a setting it cannot run.
    """
    EXTENSIONS[name] = builder


def load_package_keys() -> list[str]:
    """Call every installed ``plait.deepspeed_keys`` entry point once; return their names.

    A distribution that owns a ``ds_config`` section (plait-offload-io: the offload and ``aio``
    keys) registers its keys this way, so this package never imports it.
    """
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name not in _loaded:
            entry.load()()
            _loaded.append(entry.name)
    return list(_loaded)


def lookup(path: str) -> Key | None:
    """Return the registry entry for a dotted leaf path: the exact path, else the nearest ``*`` rule."""
    if path in KEYS:
        return KEYS[path]
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        rule = KEYS.get(".".join(parts[:cut]) + ".*")
        if rule is not None:
            return rule
    return None


def _only(expected: Any, hint: str) -> Callable[[Any], str | None]:
    return lambda value: None if value == expected or value is None else hint


def _falsy(hint: str) -> Callable[[Any], str | None]:
    return lambda value: None if not value else hint


_LOGGING = "logging/monitoring only: plait prints and logs nothing itself; use your loop's logger"
_NO_OP = "DeepSpeed-internal memory/launch tuning with no counterpart in plait's engine"

_BUILTIN = [
    Key(path="train_batch_size", action="mapped", effect="checked: = micro batch x accumulation x world size"),
    Key(path="train_micro_batch_size_per_gpu", action="mapped", effect="engine.train_micro_batch_size_per_gpu()"),
    Key(path="gradient_accumulation_steps", action="mapped",
        effect="engine.step() steps the optimizer every this many micro batches"),
    Key(path="gradient_clipping", action="mapped", effect="ZeroConfig.max_grad_norm (0: off)"),
    Key(path="fp16.enabled", action="mapped", effect="ZeroConfig.compute_dtype=torch.float16"),
    Key(path="fp16.loss_scale", action="mapped", effect="ZeroConfig.loss_scale (0: dynamic)"),
    Key(path="fp16.initial_scale_power", action="mapped", effect="ZeroConfig.initial_scale_power"),
    Key(path="fp16.loss_scale_window", action="mapped", effect="ZeroConfig.loss_scale_window, with "
        "loss_scale_window_offset=1 (DeepSpeed's first growth after the start or an overflow waits one more step)"),
    Key(path="fp16.hysteresis", action="mapped", effect="ZeroConfig.hysteresis"),
    Key(path="fp16.min_loss_scale", action="mapped", effect="ZeroConfig.min_loss_scale"),
    Key(path="fp16.consecutive_hysteresis", action="accepted", effect="false (DeepSpeed's default) only",
        check=_falsy("plait's hysteresis counts overflows since the last growth; set it to false")),
    Key(path="fp16.auto_cast", action="accepted", effect="false only",
        check=_falsy("plait casts parameters, not inputs; cast the inputs in your model and set it to false")),
    Key(path="fp16.fp16_master_weights_and_grads", action="accepted", effect="false only: masters stay fp32",
        check=_falsy("plait keeps fp32 masters; set it to false")),
    Key(path="bf16.enabled", action="mapped", effect="ZeroConfig.compute_dtype=torch.bfloat16"),
    Key(path="bf16.immediate_grad_update", action="accepted", effect=_NO_OP),
    Key(path="bf16.check_grad_overflow", action="accepted", effect="bf16 needs no loss scale; no overflow skips"),
    Key(path="communication_data_type", action="mapped", effect="ZeroConfig.reduce_dtype"),
    Key(path="prescale_gradients", action="accepted", effect="false only",
        check=_falsy("plait divides the summed gradients once after reduction; set it to false")),
    Key(path="gradient_predivide_factor", action="accepted", effect="1.0 only",
        check=_only(1.0, "plait divides the summed gradients by the world size once; set it to 1.0")),
    Key(path="optimizer.type", action="mapped",
        effect="Adam/AdamW: torch.optim.AdamW (Adam with adam_w_mode=false: torch.optim.Adam); "
               "other types when their package registers them"),
    Key(path="optimizer.params.*", action="mapped", effect="the optimizer's keyword arguments"),
    Key(path="optimizer.params.torch_adam", action="accepted", effect="plait always uses torch's Adam/AdamW"),
    Key(path="optimizer.params.fused", action="accepted", effect="torch picks its own Adam implementation"),
    Key(path="optimizer.params.adam_w_mode", action="mapped", effect="true: AdamW, false: Adam"),
    Key(path="optimizer.legacy_fusion", action="accepted", effect=_NO_OP),
    Key(path="scheduler.type", action="mapped",
        effect="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle (plait.zero_sharding.deepspeed.schedules)"),
    Key(path="scheduler.params.*", action="mapped", effect="the schedule's keyword arguments"),
    Key(path="zero_optimization.stage", action="mapped", effect="ZeroConfig.stage (1, 2 or 3)",
        check=lambda v: None if v in (1, 2, 3) else "plait's ZeRO has stages 1, 2, 3; for stage 0 use DDP"),
    Key(path="zero_optimization.reduce_bucket_size", action="mapped", effect="ZeroConfig.reduce_bucket_elements"),
    Key(path="zero_optimization.allgather_bucket_size", action="accepted",
        effect="plait all-gathers the same buckets it reduce-scatters (reduce_bucket_size)"),
    Key(path="zero_optimization.overlap_comm", action="mapped", effect="ZeroConfig.overlap_comm"),
    Key(path="zero_optimization.contiguous_gradients", action="accepted",
        effect="plait always reduces into flat contiguous buckets"),
    Key(path="zero_optimization.reduce_scatter", action="accepted", effect="plait always reduce-scatters"),
    Key(path="zero_optimization.allgather_partitions", action="accepted", effect="plait always all-gathers"),
    Key(path="zero_optimization.round_robin_gradients", action="accepted", effect=_NO_OP),
    Key(path="zero_optimization.load_from_fp32_weights", action="accepted",
        effect="plait checkpoints always hold fp32 masters and resume from them"),
    Key(path="zero_optimization.elastic_checkpoint", action="accepted",
        effect="plait checkpoints are universal: any world size loads them"),
    Key(path="zero_optimization.ignore_unused_parameters", action="accepted",
        effect="plait reduces parameters without gradients as zeros"),
    Key(path="zero_optimization.use_multi_rank_bucket_allreduce", action="accepted", effect=_NO_OP),
    Key(path="zero_optimization.sub_group_size", action="accepted",
        effect="plait steps the optimizer one unit partition at a time already"),
    Key(path="zero_optimization.stage3_prefetch_bucket_size", action="accepted",
        effect="plait prefetches whole units (ZeroConfig.prefetch, 1 unit ahead)"),
    Key(path="zero_optimization.prefetch_bucket_size", action="accepted",
        effect="plait prefetches whole units (ZeroConfig.prefetch, 1 unit ahead)"),
    Key(path="zero_optimization.stage3_param_persistence_threshold", action="mapped",
        effect="ZeroConfig.param_persistence_threshold"),
    Key(path="zero_optimization.param_persistence_threshold", action="mapped",
        effect="ZeroConfig.param_persistence_threshold"),
    Key(path="zero_optimization.stage3_model_persistence_threshold", action="accepted", effect=_NO_OP),
    Key(path="zero_optimization.stage3_max_live_parameters", action="accepted",
        effect="plait holds at most the current and `prefetch` gathered units"),
    Key(path="zero_optimization.stage3_max_reuse_distance", action="accepted",
        effect="plait frees each unit after its forward (ZeroConfig.reshard_after_forward)"),
    Key(path="zero_optimization.stage3_gather_16bit_weights_on_model_save", action="mapped",
        effect="DeepSpeedPlan.gather_16bit_weights_on_model_save (export full weights on save)"),
    Key(path="zero_optimization.stage3_gather_fp16_weights_on_model_save", action="mapped",
        effect="DeepSpeedPlan.gather_16bit_weights_on_model_save (old name)"),
    Key(path="zero_optimization.zero_quantized_weights", action="mapped",
        effect="ZeroPPConfig.quantized_weights (ZeRO++ qwZ)"),
    Key(path="zero_optimization.zero_quantized_gradients", action="mapped",
        effect="ZeroPPConfig.quantized_gradients (ZeRO++ qgZ)"),
    Key(path="zero_optimization.zero_hpz_partition_size", action="mapped",
        effect="ZeroPPConfig.hierarchical_partition_size (1: off)"),
    Key(path="zero_optimization.zero_quantized_nontrainable_weights", action="accepted", effect="false only",
        check=_falsy("plait quantizes trainable weight gathers only (zero_quantized_weights); set it to false")),
    Key(path="zero_optimization.offload_optimizer.*", action="refused",
        effect="needs plait-offload-io: install it (it registers the offload keys)"),
    Key(path="zero_optimization.offload_param.*", action="refused",
        effect="needs plait-offload-io: install it (it registers the offload keys)"),
    Key(path="zero_optimization.cpu_offload", action="refused",
        effect="DeepSpeed's old name: use zero_optimization.offload_optimizer.device='cpu'"),
    Key(path="zero_optimization.mics_shard_size", action="refused",
        effect="MiCS is not in plait: remove it (ZeRO++'s zero_hpz_partition_size is the nearest)"),
    Key(path="zero_optimization.mics_hierarchical_params_gather", action="refused",
        effect="MiCS is not in plait: remove it"),
    Key(path="zero_allow_untested_optimizer", action="accepted",
        effect="plait checks the optimizer itself (ZeroConfig.elementwise_optimizer)"),
    Key(path="zero_force_ds_cpu_optimizer", action="accepted", effect=_NO_OP),
    Key(path="sequence_parallel_size", action="mapped",
        effect="DeepSpeedPlan.sequence_parallel_size (the sp dimension of plait-ulysses-sp's mesh)"),
    Key(path="checkpoint.tag_validation", action="accepted",
        effect="plait checks every rank loads the same step itself"),
    Key(path="checkpoint.load_universal", action="accepted", effect="plait checkpoints are always universal"),
    Key(path="checkpoint.use_node_local_storage", action="accepted", effect="plait writes one shared directory"),
    Key(path="checkpoint.parallel_write.*", action="accepted", effect="plait's writer picks its own parallelism"),
    Key(path="steps_per_print", action="accepted", effect=_LOGGING),
    Key(path="wall_clock_breakdown", action="accepted", effect=_LOGGING + " (plait's StepBreakdown times steps)"),
    Key(path="memory_breakdown", action="accepted", effect=_LOGGING),
    Key(path="dump_state", action="accepted", effect=_LOGGING),
    Key(path="flops_profiler.*", action="accepted", effect=_LOGGING + " (use torch.profiler)"),
    Key(path="tensorboard.*", action="accepted", effect=_LOGGING),
    Key(path="wandb.*", action="accepted", effect=_LOGGING),
    Key(path="csv_monitor.*", action="accepted", effect=_LOGGING),
    Key(path="comet.*", action="accepted", effect=_LOGGING),
    Key(path="comms_logger.*", action="accepted", effect=_LOGGING),
    Key(path="timers.*", action="accepted", effect=_LOGGING),
    Key(path="activation_checkpointing.*", action="accepted",
        effect="configures deepspeed.checkpointing calls in model code; use torch.utils.checkpoint there"),
    Key(path="amp.enabled", action="accepted", effect="false only",
        check=_falsy("NVIDIA apex amp is not supported; use bf16.enabled or fp16.enabled")),
    Key(path="amp.*", action="refused", effect="NVIDIA apex amp is not supported: use bf16 or fp16 blocks"),
    Key(path="data_types.grad_accum_dtype", action="accepted", effect="fp32 or unset only",
        check=lambda v: None if v in (None, "fp32", "float32") else "plait accumulates gradients in the "
        "compute dtype then reduces in ZeroConfig.reduce_dtype; remove it or set it to 'fp32'"),
    Key(path="pipeline.*", action="refused", effect="pipeline parallelism is not in plait: remove the block"),
    Key(path="compression_training.*", action="refused", effect="not in plait: remove the block"),
    Key(path="data_efficiency.*", action="refused", effect="not in plait: sample your data in your loop"),
    Key(path="curriculum_learning.*", action="refused", effect="not in plait: remove the block"),
    Key(path="elasticity.*", action="refused", effect="not in plait: fix the batch keys instead"),
    Key(path="autotuning.*", action="refused", effect="not in plait: remove the block"),
    Key(path="sparse_attention.*", action="refused", effect="not in plait: remove the block"),
    Key(path="aio.*", action="refused", effect="needs plait-offload-io: install it (it registers the aio keys)"),
]

register_keys(_BUILTIN)


def key_table_markdown(keys: Iterable[Key] | None = None) -> str:
    """Return a README table of keys (sorted by path) and what plait does with each.

    Args:
        keys: the rows; default: this package's own (what a lone plait-zero-sharding does, the
            keys of other packages shown as refused with the install to add). A package that
            registers keys renders its own rows for its README.
    """
    rows = ["| DeepSpeed key | plait | what it does in plait |", "|---|---|---|"]
    for key in sorted(_BUILTIN if keys is None else keys, key=lambda k: k.path):
        rows.append(f"| `{key.path}` | {key.action} | {key.effect} |")
    return "\n".join(rows) + "\n"
