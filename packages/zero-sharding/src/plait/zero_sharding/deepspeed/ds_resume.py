"""Resume a checkpoint written by DeepSpeed itself (ZeRO 1/2/3) on the plait engine.

plait-universal-ckpt's offline DeepSpeed importer converts the tag directory once into a
universal checkpoint under ``<load_dir>/plait-universal/`` (DeepSpeed's own files are left as
they are; a second resume reuses the conversion). That checkpoint holds the fp32 masters, the
Adam moments and step counts and the loss scale; this module loads it into the sharded model,
then restores what DeepSpeed keeps beside it: ``global_steps``, ``global_samples``,
``skipped_steps``, the scheduler state and the script's ``client_state``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

IMPORT_DIR = "plait-universal"

# Keys DeepSpeed writes into mp_rank_00_model_states.pt besides the script's client_state.
_DEEPSPEED_KEYS = frozenset({
    "module", "optimizer", "lr_scheduler", "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "data_sampler", "random_ltd",
    "checkpoint_parallel_dimensions",
})


def deepspeed_tag_dir(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """Return the DeepSpeed tag directory ``load_dir`` (and ``tag`` or its ``latest`` file) names, or ``None``."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8").strip()
    path = root / str(tag)
    return path if any(path.glob("*model_states.pt")) else None


class _Extras:
    """Receives the importer's ``deepspeed`` object (counters, scheduler state, groups)."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = dict(state)


def _converted(tag_dir: Path) -> Path:
    from plait.universal_ckpt import latest, read_manifest
    from plait.universal_ckpt.interop.deepspeed import import_deepspeed

    target = tag_dir.parent / IMPORT_DIR / tag_dir.name
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and latest(target) is None:
        import_deepspeed(tag_dir, target)
    if dist.is_initialized():
        dist.barrier()
    found = latest(target)
    if found is None or (read_manifest(found).user_meta or {}).get("source") != str(tag_dir):
        raise RuntimeError(f"the conversion of the DeepSpeed checkpoint {os.fspath(tag_dir)!r} is missing or "
                           f"names another source under {os.fspath(target)!r}; delete that directory and resume again.")
    return found


def client_state(tag_dir: Path) -> dict[str, Any]:
    """What a script saved beside DeepSpeed's own keys in ``tag_dir`` (its ``client_state``).

    Args:
        tag_dir: DeepSpeed's tag directory.

    Returns:
        The model-states file's entries that are not DeepSpeed's (Lightning's checkpoint dict,
        for a checkpoint written by Lightning's ``DeepSpeedStrategy``).
    """
    from plait.universal_ckpt.interop.deepspeed import _load

    model_file = tag_dir / "mp_rank_00_model_states.pt"
    if not model_file.exists():
        model_file = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return {k: v for k, v in _load(model_file).items() if k not in _DEEPSPEED_KEYS}


def load_into_module(module: Any, tag_dir: Path) -> dict[str, Any]:
    """Load DeepSpeed's checkpoint ``tag_dir`` into a sharded model (collective: every rank calls it).

    The parameters, fp32 masters and optimizer moments go into ``module`` (a ``ZeroModule`` at any
    world size or ZeRO stage); what DeepSpeed keeps beside them is returned.

    Args:
        module: the sharded model.
        tag_dir: DeepSpeed's tag directory (``global_stepN``).

    Returns:
        DeepSpeed's counters and states: ``global_steps``, ``global_samples``, ``skipped_steps``,
        ``lr_scheduler`` (those present).

    Raises:
        plait.universal_ckpt.CheckpointError: a layout the importer does not read (named by it).
    """
    from plait.universal_ckpt import load

    extras = _Extras()
    load({"model": module, "deepspeed": extras}, _converted(tag_dir), strict=False)
    return extras.value


def load_deepspeed_checkpoint(engine: Any, tag_dir: Path, *, load_lr_scheduler_states: bool) -> tuple[str, dict]:
    """Load DeepSpeed's checkpoint ``tag_dir`` into ``engine`` (collective: every rank calls it).

    Args:
        engine: the plait DeepSpeed engine (any world size or ZeRO stage).
        tag_dir: DeepSpeed's tag directory.
        load_lr_scheduler_states: restore the scheduler's iteration too.

    Returns:
        ``(tag_dir, client_state)`` as DeepSpeed's ``load_checkpoint`` returns them.

    Raises:
        plait.universal_ckpt.CheckpointError: a layout the importer does not read (named by it).
    """
    saved = load_into_module(engine.module, tag_dir)
    engine.global_steps = int(saved.get("global_steps") or 0)
    engine.global_samples = int(saved.get("global_samples") or engine.global_steps * engine.train_batch_size())
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    engine.optimizer.steps_taken = engine.global_steps
    if load_lr_scheduler_states and engine.lr_scheduler is not None and saved.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    return os.fspath(tag_dir), client_state(tag_dir)
