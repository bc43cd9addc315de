"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` as plait universal checkpoints.

A save writes one universal checkpoint (plait-universal-ckpt) under the directory DeepSpeed's
call names: the sharded model (parameters, fp32 masters, optimizer moments, loss scale), the
optimizer's group options and step count, the scheduler, the engine's counters and the
script's ``client_state``; the DeepSpeed ``tag`` is kept in the manifest and the root's
``latest`` pointer moves to it. Being universal, it loads at any world size or ZeRO stage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _universal_ckpt() -> Any:
    try:
        import plait.universal_ckpt as universal_ckpt
    except ImportError as exc:  # an optional dependency: only checkpoints need it
        raise ImportError("engine.save_checkpoint/load_checkpoint need plait-universal-ckpt; "
                          "pip install 'plait-zero-sharding[checkpoint]'.") from exc
    return universal_ckpt


class _Options:
    """The optimizer's replicated options (lr, betas, ...) and step count; moments travel with the model."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"param_groups": groups, "steps_taken": int(self.optimizer.steps_taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"the checkpoint has {len(state['param_groups'])} optimizer parameter groups, this "
                             f"engine {len(self.optimizer.param_groups)}; build the optimizer with the same groups.")
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        self.optimizer.steps_taken = int(state["steps_taken"])


class _Counters:
    """The engine's step counters."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, int]:
        e = self.engine
        return {"global_steps": e.global_steps, "global_samples": e.global_samples, "micro_steps": e.micro_steps,
                "skipped_steps": e.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name, value in state.items():
            setattr(self.engine, name, int(value))


class _ClientState:
    """The script's ``client_state`` dict (pickled; every rank saves its own, as DeepSpeed does)."""

    def __init__(self, value: dict[str, Any] | None = None) -> None:
        self.value = dict(value or {})

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = dict(state)


def _state(engine: Any, client: _ClientState, *, scheduler: bool) -> dict[str, Any]:
    state = {"model": engine.module, "optimizer": _Options(engine.optimizer), "engine": _Counters(engine),
             "client_state": client}
    if scheduler and engine.lr_scheduler is not None:
        state["lr_scheduler"] = engine.lr_scheduler
    return state


def save_checkpoint(engine: Any, save_dir: str | os.PathLike[str], tag: str | None = None,
                    client_state: dict[str, Any] | None = None) -> Path:
    """Save the engine's training state under ``save_dir`` (collective: every rank calls it).

    Args:
        engine: the :class:`~plait.zero_sharding.deepspeed.engine.DeepSpeedEngine`.
        save_dir: the checkpoint root (DeepSpeed's ``save_dir``).
        tag: DeepSpeed's tag (default ``global_step<N>``), recorded in the manifest.
        client_state: the script's extra state, returned by :func:`load_checkpoint`.

    Returns:
        The committed checkpoint directory.

    Raises:
        plait.universal_ckpt.CheckpointExistsError: this step is already saved there (nothing is overwritten).
    """
    universal_ckpt = _universal_ckpt()
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    state = _state(engine, _ClientState(client_state), scheduler=True)
    return universal_ckpt.save(state, save_dir, step=engine.global_steps, user_meta={"deepspeed_tag": tag}).wait()


def _find_tag(universal_ckpt: Any, root: Path, tag: str) -> Path:
    for candidate in sorted(root.glob("step-*")):
        try:
            meta = universal_ckpt.read_manifest(candidate).user_meta or {}
        except universal_ckpt.CheckpointError:
            continue
        if meta.get("deepspeed_tag") == tag:
            return candidate
    raise FileNotFoundError(f"no checkpoint with tag {tag!r} under {os.fspath(root)!r}; "
                            "pass tag=None for the latest one.")


def load_checkpoint(engine: Any, load_dir: str | os.PathLike[str], tag: str | None = None,
                    load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True) -> tuple[str | None, dict[str, Any]]:
    """Load a checkpoint saved by :func:`save_checkpoint`, or by DeepSpeed itself, into ``engine``.

    Both load at any world size or ZeRO stage; a DeepSpeed directory (a ``latest`` file naming a
    tag directory with ``*model_states.pt``) goes through :mod:`plait.zero_sharding.deepspeed.ds_resume`.

    Args:
        engine: the engine to restore.
        load_dir: the checkpoint root.
        tag: the DeepSpeed tag to load (``None``: the latest).
        load_optimizer_states: must be ``True``: the fp32 masters and moments are one sharded state.
        load_lr_scheduler_states: restore the scheduler too.

    Returns:
        ``(checkpoint path, client_state)``; ``(None, {})`` when ``load_dir`` holds no checkpoint,
        as DeepSpeed returns.

    Raises:
        ValueError: ``load_optimizer_states=False``.
        FileNotFoundError: no checkpoint with ``tag``.
    """
    if not load_optimizer_states:
        raise ValueError("load_checkpoint(load_optimizer_states=False) is not supported: plait restores the fp32 "
                         "masters and optimizer moments together with the weights; load the full state.")
    universal_ckpt = _universal_ckpt()
    from plait.zero_sharding.deepspeed.ds_resume import deepspeed_tag_dir, load_deepspeed_checkpoint

    tag_dir = deepspeed_tag_dir(load_dir, tag)
    if tag_dir is not None:  # written by DeepSpeed itself
        return load_deepspeed_checkpoint(engine, tag_dir, load_lr_scheduler_states=load_lr_scheduler_states)
    root = Path(load_dir)
    if tag is None and universal_ckpt.latest(root) is None:
        return None, {}
    path = universal_ckpt.latest(root) if tag is None else _find_tag(universal_ckpt, root, str(tag))
    client = _ClientState()
    universal_ckpt.load(_state(engine, client, scheduler=load_lr_scheduler_states), path)
    return os.fspath(path), client.value
