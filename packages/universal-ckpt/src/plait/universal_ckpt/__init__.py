"""plait.universal_ckpt: save in the distributed layout, load into any other.

Checkpoints are directories with a JSON manifest (names, kinds, shapes, dtypes, where every
piece lives, its size and hashes) and per-rank data files written in parallel. Saves commit
atomically and move a ``latest`` pointer; loads reshard to any world size or ZeRO stage, reading
only the byte ranges each rank needs, and verify hashes by default. Model-parallel modules
(tensor, pipeline, expert layouts) save in consolidated form through :func:`model_parallel`. See the package README for
the on-disk format.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public names -> the module defining them. They load on first use (PEP 562), so importing a
# light submodule (the `plait ckpt` command's parser, the errors) does not import torch.
_EXPORTS = {
    "RNGState": "adapters",
    **dict.fromkeys(("CheckpointConfig", "CheckpointManager", "latest", "load", "save", "wait_pending"), "api"),
    **dict.fromkeys(("CheckpointError", "CheckpointExistsError", "CheckpointFormatError", "CheckpointIntegrityError",
                     "CheckpointLayoutError", "CheckpointNotFoundError", "CheckpointWriteError", "PathEscapeError",
                     "SaveInFlightError", "UnsafeObjectError"),
                    "errors"),
    "TensorLayout": "layouts",
    **dict.fromkeys(("FORMAT_VERSION", "Layout", "Manifest", "TensorEntry"), "manifest"),
    **dict.fromkeys(("ModelParallelConfig", "ModelParallelState", "global_identity_config", "layer_offset",
                     "model_parallel"), "parallel_layout"),
    **dict.fromkeys(("read_full", "read_manifest", "verify_checkpoint"), "reader"),
    "SaveHandle": "saver",
    **dict.fromkeys(("allowed_globals", "register_safe_types"), "safe_objects"),
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from plait.universal_ckpt.adapters import RNGState
    from plait.universal_ckpt.api import CheckpointConfig, CheckpointManager, latest, load, save, wait_pending
    from plait.universal_ckpt.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointFormatError,
        CheckpointIntegrityError,
        CheckpointLayoutError,
        CheckpointNotFoundError,
        CheckpointWriteError,
        PathEscapeError,
        SaveInFlightError,
        UnsafeObjectError,
    )
    from plait.universal_ckpt.layouts import TensorLayout
    from plait.universal_ckpt.manifest import FORMAT_VERSION, Layout, Manifest, TensorEntry
    from plait.universal_ckpt.parallel_layout import (
        ModelParallelConfig,
        ModelParallelState,
        global_identity_config,
        layer_offset,
        model_parallel,
    )
    from plait.universal_ckpt.reader import read_full, read_manifest, verify_checkpoint
    from plait.universal_ckpt.safe_objects import allowed_globals, register_safe_types
    from plait.universal_ckpt.saver import SaveHandle


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"plait.universal_ckpt.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'plait.universal_ckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "FORMAT_VERSION", "CheckpointConfig", "CheckpointError", "CheckpointExistsError", "CheckpointFormatError",
    "CheckpointIntegrityError", "CheckpointLayoutError", "CheckpointManager", "CheckpointNotFoundError",
    "CheckpointWriteError", "Layout", "Manifest", "ModelParallelConfig", "ModelParallelState", "RNGState",
    "SaveHandle", "SaveInFlightError", "TensorEntry", "TensorLayout", "global_identity_config", "latest",
    "layer_offset", "load",
    "model_parallel", "PathEscapeError", "UnsafeObjectError", "allowed_globals", "register_safe_types",
    "read_full", "read_manifest", "save", "verify_checkpoint", "wait_pending",
]
