"""plait.universal_ckpt: save in the distributed layout, load into any other.

Checkpoints are directories with a JSON manifest (names, kinds, shapes, dtypes, where every
piece lives, its size and hashes) and per-rank data files written in parallel. Saves commit
atomically and move a ``latest`` pointer; loads reshard to any world size or ZeRO stage, reading
only the byte ranges each rank needs, and verify hashes by default. Model-parallel modules
(tensor, pipeline, expert layouts) save in consolidated form through :func:`model_parallel`. See the package README for
the on-disk format.
"""

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
    SaveInFlightError,
)
from plait.universal_ckpt.layouts import TensorLayout
from plait.universal_ckpt.manifest import FORMAT_VERSION, Layout, Manifest, TensorEntry
from plait.universal_ckpt.model_parallel import ModelParallelConfig, ModelParallelState, layer_offset, model_parallel
from plait.universal_ckpt.reader import read_full, read_manifest, verify_checkpoint
from plait.universal_ckpt.saver import SaveHandle

__all__ = [
    "FORMAT_VERSION", "CheckpointConfig", "CheckpointError", "CheckpointExistsError", "CheckpointFormatError",
    "CheckpointIntegrityError", "CheckpointLayoutError", "CheckpointManager", "CheckpointNotFoundError",
    "CheckpointWriteError", "Layout", "Manifest", "ModelParallelConfig", "ModelParallelState", "RNGState",
    "SaveHandle", "SaveInFlightError", "TensorEntry", "TensorLayout", "latest", "layer_offset", "load",
    "model_parallel", "read_full", "read_manifest", "save", "verify_checkpoint", "wait_pending",
]
