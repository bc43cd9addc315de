"""Directory checkpoints through plait-universal-ckpt, and the way to get consolidated weights out.

A plait strategy's checkpoint path is a directory (``ModelCheckpoint``'s ``epoch=0-step=10.ckpt``
becomes one): a universal checkpoint whose ``model`` key holds the sharded model *and* its
optimizer moments (ZeRO's sharded-state view, so it loads at any world size and stage) and whose
``lightning`` key holds everything else Lightning or the user saved (loops, callbacks, LR
schedulers, optimizer options, hyper-parameters) as a small object file per rank, read back
with a restricted unpickler (plait.universal_ckpt's safe-type allowlist).

Getting weights out, with no GPU and no process group::

    from plait.lightning import consolidated_state_dict, export_weights
    state = consolidated_state_dict("checkpoints/last.ckpt")     # {name: full fp32 tensor}
    export_weights("checkpoints/last.ckpt", "hf-out/", strip="model.")  # HF safetensors + index
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import universal_ckpt
from plait.kernels import collectives
from plait.kernels.state_names import tied_aliases, with_aliases
from plait.universal_ckpt.directory import resolve
from plait.universal_ckpt.interop.hf import TIED_ALIASES, export_hf

MODEL_KEY = "model"
LIGHTNING_KEY = "lightning"
# ZeroModule.sharded_state_dict names its parameter pieces "model.<parameter name>".
PIECE_PREFIX = "model."
PRODUCER = "plait.lightning"


def _rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier(name: str) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.barrier(name=name)  # named: a rank missing from it is named with it


def is_directory_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a plait universal checkpoint (a root or one step directory)."""
    try:
        universal_ckpt.read_manifest(resolve(path))
    except universal_ckpt.CheckpointError:
        return False
    return True


def deepspeed_tag(path: str | os.PathLike) -> Path | None:
    """The DeepSpeed tag directory of a checkpoint Lightning's ``DeepSpeedStrategy`` (or DeepSpeed)
    wrote at ``path``, or ``None`` when ``path`` is not one."""
    from plait.zero_sharding.deepspeed.ds_resume import deepspeed_tag_dir

    return deepspeed_tag_dir(path, None) if Path(path).is_dir() else None


def load_deepspeed_directory(module: Any, tag_dir: Path) -> dict[str, Any]:
    """Load a DeepSpeed checkpoint into a plait-sharded LightningModule (collective).

    The weights, fp32 masters and Adam moments go into ``module`` at this world size and ZeRO
    stage (through plait-universal-ckpt's DeepSpeed importer); Lightning's own part of the
    checkpoint (``epoch``, ``global_step``, ``loops``, ``lr_schedulers``, callbacks...) is what
    Lightning's ``DeepSpeedStrategy`` saved as DeepSpeed's ``client_state``.

    Args:
        module: the sharded LightningModule.
        tag_dir: DeepSpeed's tag directory (``<checkpoint>/checkpoint`` for Lightning's).

    Returns:
        Lightning's checkpoint dict, with ``optimizer_states`` holding the optimizer's options and
        step count from DeepSpeed's optimizer (see :func:`optimizer_options`).
    """
    from plait.zero_sharding.deepspeed.ds_resume import client_state, load_into_module

    saved = load_into_module(ShardedModelView(module), tag_dir)
    loaded = client_state(tag_dir)
    loaded.pop("optimizer_states", None)
    groups = saved.get("param_groups")
    if groups:
        options = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        loaded["optimizer_states"] = [{"param_groups": options, "steps_taken": int(saved.get("global_steps") or 0)}]
    return loaded


def optimizer_options(optimizer: Any) -> dict[str, Any]:
    """A ZeroOptimizer's small replicated state: group options (lr, betas...) and the step count.
    Its moments and masters are in the model's sharded state."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"param_groups": groups, "steps_taken": int(getattr(optimizer, "steps_taken", 0))}


def load_optimizer_options(optimizer: Any, state: dict[str, Any]) -> None:
    """Restore :func:`optimizer_options` (LR schedulers do not restore ``lr`` themselves).

    Raises:
        ValueError: the number of parameter groups differs from the checkpoint's.
    """
    saved = state["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint has {len(saved)} optimizer parameter groups, the optimizer has "
                         f"{len(optimizer.param_groups)}; configure_optimizers must build the same groups.")
    for group, options in zip(optimizer.param_groups, saved):
        group.update(options)
    if hasattr(optimizer, "steps_taken"):
        optimizer.steps_taken = int(state.get("steps_taken", 0))


class OptimizerOptions:
    """Stateful view of a ZeroOptimizer for a universal checkpoint (see :func:`optimizer_options`)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """See :func:`optimizer_options`."""
        return optimizer_options(self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :func:`load_optimizer_options`."""
        load_optimizer_options(self.optimizer, state)


class ShardedModelView:
    """A sharded model's ``ShardedStateful`` view, with the replica ranks of per-parameter scalar
    optimizer state (Adam's ``step``) widened to every rank holding a piece of that parameter.

    ``ZeroModule.sharded_state_dict`` names as replicas of a step counter only the ranks holding
    *this rank's piece* of the parameter, so for a parameter split across ranks each rank thinks
    it is the only writer and the checkpoint refuses the overlap. The ranks holding any piece of
    ``model.<name>`` are exchanged once here (one small all-gather of names) and the counters'
    ``replica_ranks`` set to them; the lowest one writes, as for any replicated piece.
    """

    def __init__(self, module: Any) -> None:
        self.module = module

    def sharded_state_dict(self) -> dict[str, Any]:
        """The module's pieces with corrected replica ranks (collective when distributed)."""
        pieces = self.module.sharded_state_dict()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return pieces
        mine = sorted(name for name in pieces if name.startswith(PIECE_PREFIX))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        holders: dict[str, list[int]] = {}
        for rank, names in enumerate(everyone):
            for name in names:
                holders.setdefault(name[len(PIECE_PREFIX):], []).append(rank)
        out = {}
        for name, piece in pieces.items():
            spec = piece.spec
            if name.startswith("optim.") and spec.global_shape == ():
                param = name.split(".", 2)[2]
                ranks = tuple(holders.get(param, spec.replica_ranks))
                piece = dataclasses.replace(piece, spec=dataclasses.replace(spec, replica_ranks=ranks))
            out[name] = piece
        return out

    def checkpoint_aliases(self) -> dict[str, str]:
        """The module's tied names in the pieces' naming (recorded by plait.universal_ckpt.save)."""
        return tied_aliases(self.module, prefix=PIECE_PREFIX)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Hand the filled pieces to the module."""
        self.module.load_sharded_state_dict(state)


def save_directory(path: str | os.PathLike, state: dict[str, Any], *, step: int,
                   aliases: dict[str, str] | None = None, allow_pickle: bool = False) -> Path:
    """Save ``state`` as the universal checkpoint directory ``path``, replacing what is there as a
    file save would, but only once the new checkpoint has committed. Collective: every rank calls it.

    Lightning rewrites one path again and again (``ModelCheckpoint(save_last=True)``'s
    ``last.ckpt``, a user's fixed ``save_checkpoint`` path). Removing the old checkpoint first would
    leave nothing there if the job were killed during the save, which is when it is needed; so a
    checkpoint that exists is replaced by writing the new one beside it (``.<name>.saving``) and
    swapping the two directories once it has committed.

    Args:
        path: the checkpoint path Lightning gave.
        state: the checkpoint dict (tensors, and non-tensor state of plait's safe-type allowlist;
            ``MODEL_KEY`` holds the sharded model's view).
        step: the global step.
        aliases: the model's tied names, ``{alias: canonical}`` in the checkpoint's naming
            (:func:`plait.kernels.state_names.tied_aliases`); recorded in the manifest so that
            :func:`consolidated_state_dict` and :func:`export_weights` give every name back.
        allow_pickle: store non-tensor values outside the allowlist anyway; loading the result
            then needs ``trust_pickled_objects=True`` (see plait.universal_ckpt.save).

    Returns:
        The committed step directory.

    Raises:
        plait.universal_ckpt.UnsafeObjectError: a value outside the allowlist (names its key path).
    """
    root = Path(path)
    meta: dict[str, Any] = {"producer": PRODUCER}
    if aliases:
        meta[TIED_ALIASES] = {MODEL_KEY: dict(aliases)}
    if not _rank_zero_sees(root):
        return universal_ckpt.save(state, root, step=int(step), user_meta=meta, allow_pickle=allow_pickle).wait()
    staging = root.with_name(f".{root.name}.saving")
    if _rank_zero():
        _remove(staging)  # what a save killed part-way left
    _barrier("checkpoint staging directory cleared")
    committed = universal_ckpt.save(state, staging, step=int(step), user_meta=meta,
                                    allow_pickle=allow_pickle).wait()
    if _rank_zero():
        _swap_in(staging, root)
    _barrier("checkpoint swapped in")
    return root / committed.name


def _rank_zero_sees(path: Path) -> bool:
    """Whether something is at ``path``, as rank 0 sees it, on every rank.

    Every rank must take the same branch of :func:`save_directory` (their collectives differ), and
    a rank that looked after rank 0 had begun writing a new checkpoint there would see one.
    """
    seen = torch.tensor([path.exists() or path.is_symlink()], dtype=torch.uint8)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":  # NCCL moves only device tensors
            seen = seen.to(torch.device("cuda", torch.cuda.current_device()))
        collectives.broadcast(seen, src=0, name="checkpoint path check (rank 0's view)")
    return bool(seen.item())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _swap_in(new: Path, old: Path) -> None:
    """Put the directory ``new`` at ``old``'s path and delete what was there.

    Linux swaps the two names in one step (``renameat2`` with ``RENAME_EXCHANGE``), so there is no
    moment without a checkpoint at ``old``; elsewhere (or a file system without it) two renames
    leave a moment of microseconds in which ``old`` is at ``.<name>.replaced`` instead.
    """
    if not _exchange(new, old):
        aside = old.with_name(f".{old.name}.replaced")
        _remove(aside)
        os.rename(old, aside)
        os.rename(new, old)
        new = aside
    _remove(new)  # the old checkpoint, now at the other name


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically; False where the system cannot."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False  # a C library without it (glibc before 2.28)
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def load_directory(path: str | os.PathLike, state: dict[str, Any], *, verify: bool = True,
                   strict: bool = True, trust_pickled_objects: bool = False) -> universal_ckpt.Manifest:
    """Load a universal checkpoint into ``state`` in place (resharding to this world size).

    Args:
        path: the checkpoint directory.
        state: the targets, filled in place.
        verify: check every hash read.
        strict: every key must be in the checkpoint.
        trust_pickled_objects: allow a checkpoint saved with ``allow_pickle=True`` (its objects
            are then unpickled without restriction: only for checkpoints you trust).

    Raises:
        plait.universal_ckpt.CheckpointError: missing, damaged or incompatible checkpoint.
    """
    return universal_ckpt.load(state, path, verify=verify, strict=strict,
                               trust_pickled_objects=trust_pickled_objects)


def _strip(name: str, strip: str) -> str:
    name = name[len(PIECE_PREFIX):] if name.startswith(PIECE_PREFIX) else name
    return name[len(strip):] if strip and name.startswith(strip) else name


def consolidated_state_dict(checkpoint: str | os.PathLike, *, strip: str = "", dtype: torch.dtype | None = None,
                            verify: bool = True) -> dict[str, torch.Tensor]:
    """Whole parameters of a plait Lightning checkpoint, read in one process (any saved world size).

    Args:
        checkpoint: a checkpoint directory (root or step directory).
        strip: a further name prefix to remove (e.g. ``"model."`` for the model held as
            ``self.model`` inside a LightningModule).
        dtype: cast floating tensors (default: fp32 masters as saved).
        verify: check hashes while reading.

    Returns:
        ``{name: tensor}`` in the LightningModule's ``state_dict`` naming (minus ``strip``), with
        every name of a tied tensor (a head sharing the embedding's weight), as the module's own
        ``state_dict`` has them, so ``load_state_dict(strict=True)`` takes it.
    """
    ckpt = resolve(checkpoint)
    manifest = universal_ckpt.read_manifest(ckpt)
    out: dict[str, torch.Tensor] = {}
    for entry in manifest.tensors.values():
        if entry.key == MODEL_KEY and entry.kind in ("parameter", "buffer"):
            tensor = universal_ckpt.read_full(ckpt, manifest, entry, verify=verify)
            out[_strip(entry.name, strip)] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() \
                else tensor
    aliases = manifest.user_meta.get(TIED_ALIASES, {}).get(MODEL_KEY, {})
    return with_aliases(out, {_strip(a, strip): _strip(c, strip) for a, c in aliases.items()})


def export_weights(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, strip: str = "",
                   dtype: torch.dtype | None = None, config: Any = None,
                   max_shard_bytes: int = 2 << 30) -> Path:
    """Write consolidated weights as Hugging Face safetensors shards plus their index.

    Args:
        checkpoint: a checkpoint directory.
        out_dir: output directory (created).
        strip: a further name prefix to remove (see :func:`consolidated_state_dict`).
        dtype: cast floating tensors (e.g. ``torch.bfloat16``).
        config: an HF config (``save_pretrained``) or a dict written as ``config.json``.
        max_shard_bytes: size bound of each safetensors shard.

    Returns:
        ``out_dir``.
    """
    return export_hf(checkpoint, out_dir, key=MODEL_KEY, dtype=dtype, config=config,
                     max_shard_bytes=max_shard_bytes, rename=lambda name: _strip(name, strip))


def checkpoint_bytes(checkpoint: str | os.PathLike) -> int:
    """Bytes on disk of one checkpoint (the step directory)."""
    ckpt = resolve(checkpoint)
    return sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
