"""The checkpoint root: committed step directories, the ``latest`` pointer, leftovers and pruning.

A root holds ``step-<step, 10 digits>/`` directories that are committed (renamed into place
after their manifest was fsynced), a ``latest`` file naming one of them, and possibly leftovers
of interrupted saves (``.tmp-*``) or prunes (``.trash-*``). Only names starting with ``step-``
that contain a manifest are ever returned as checkpoints, so a partial save is never picked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from plait.universal_ckpt.errors import CheckpointNotFoundError
from plait.universal_ckpt.manifest import MAGIC, MANIFEST_NAME
from plait.universal_ckpt.storage import fsync_dir, replace_durable

LATEST_NAME = "latest"
_STEP_RE = re.compile(r"^step-(\d{10})$")


def step_dir_name(step: int) -> str:
    """Directory name of a committed checkpoint (zero-padded so names sort by step)."""
    return f"step-{step:010d}"


def tmp_dir_name(step: int) -> str:
    """Name of the in-progress directory of a save (hidden; never a checkpoint)."""
    return f".tmp-{step_dir_name(step)}"


def is_plait_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint directory plait committed (what pruning may delete).

    A real directory (not a symlink) holding a regular-file manifest (not a symlink) whose JSON
    carries plait's magic. A directory a user put in the root, or a link to one, is not.
    """
    manifest = path / MANIFEST_NAME
    if path.is_symlink() or not path.is_dir() or manifest.is_symlink() or not manifest.is_file():
        return False
    try:
        body = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(body, dict) and body.get("magic") == MAGIC


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root`` as ``(step, path)``, oldest first (see :func:`is_plait_checkpoint`)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and is_plait_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``root``'s ``latest`` pointer names, or the newest committed one.

    The pointer is trusted only when it names a committed directory; a pointer left dangling
    (its target pruned or damaged by hand) falls back to the newest committed checkpoint.

    Args:
        root: the checkpoint root given to :func:`plait.universal_ckpt.save`.

    Returns:
        The checkpoint directory, or None when the root holds no committed checkpoint.
    """
    root = Path(root)
    pointer = root / LATEST_NAME
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_RE.match(name) and is_plait_checkpoint(root / name):
            return root / name
    found = committed(root)
    return found[-1][1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from either a checkpoint directory or a root (its latest).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no committed checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist.")
    if (path / MANIFEST_NAME).is_file():
        return path
    found = latest(path)
    if found is None:
        raise CheckpointNotFoundError(
            f"{path} holds no committed plait checkpoint (no {MANIFEST_NAME}, no step-* directory with one).")
    return found


def point_latest(root: Path, step: int) -> None:
    """Atomically move the ``latest`` pointer to ``step``."""
    replace_durable(root / LATEST_NAME, (step_dir_name(step) + "\n").encode())


def clean_leftovers(root: Path) -> list[Path]:
    """Remove ``.tmp-*`` and ``.trash-*`` leftovers of interrupted saves and prunes.

    Only call this while no save is running on ``root`` (rank 0 does, at the start of a save).

    Returns:
        The removed paths.
    """
    removed = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if child.name.startswith((".tmp-", ".trash-")):
            if child.is_symlink():  # the link only: never what it points to
                child.unlink(missing_ok=True)
            elif child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
    return removed


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints (never the latest).

    Each victim is first renamed to ``.trash-*`` (atomic), so an interrupted prune leaves a
    leftover, never a half-deleted directory that still looks committed.

    Returns:
        The checkpoint directories removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (or None to keep everything).")
    current = latest(root)
    found = committed(root)
    victims = [path for _, path in found[:-keep_last] if path != current]
    for path in victims:
        trash = root / f".trash-{path.name}"
        if trash.exists():
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
    if victims:
        fsync_dir(root)
    for path in victims:
        shutil.rmtree(root / f".trash-{path.name}", ignore_errors=True)
    return victims


def commit(root: Path, step: int) -> Path:
    """Rename a finished ``.tmp`` directory to its committed name and make the rename durable."""
    tmp, final = root / tmp_dir_name(step), root / step_dir_name(step)
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    return final
