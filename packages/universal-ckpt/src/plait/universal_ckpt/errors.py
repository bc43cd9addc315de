"""The errors a checkpoint operation raises; every one names what is wrong and the way out.

They share one base class so a training loop can catch "the checkpoint failed" in one place,
and they are distinct types so a test (or a retry policy) can tell a full disk from a corrupt
file from a layout that cannot hold the state.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every error plait.universal_ckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no committed plait checkpoint (missing, empty, or only leftovers)."""


class CheckpointFormatError(CheckpointError):
    """The directory is not a plait checkpoint, or its manifest is damaged or from a newer format."""


class CheckpointIntegrityError(CheckpointError):
    """A file's bytes do not match the manifest: wrong hash, wrong size, or missing.

    Attributes:
        file: the file (relative to the checkpoint directory) that failed.
        expected: the hash or size the manifest records.
        actual: what was found on disk.
    """

    def __init__(self, message: str, *, file: str, expected: str, actual: str) -> None:
        super().__init__(message)
        self.file = file
        self.expected = expected
        self.actual = actual


class CheckpointLayoutError(CheckpointError, ValueError):
    """The target state cannot hold the checkpoint (missing tensors, other shapes or dtypes)."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed on at least one rank (disk full, permission, I/O error); nothing was committed."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint for this step already exists; saves never overwrite one."""


class SaveInFlightError(CheckpointError):
    """An async save is still running and the caller asked not to wait for it."""


class UnsafeObjectError(CheckpointError, TypeError):
    """Non-tensor state outside plait's allowlist: refused at save, or refused at load untrusted.

    Attributes:
        key_path: where the value is (``key['field'][0]``) at save time, or the file at load time.
        type_name: the refused type or global, as ``module.qualname``.
    """

    def __init__(self, message: str, *, key_path: str, type_name: str) -> None:
        super().__init__(message)
        self.key_path = key_path
        self.type_name = type_name


class PathEscapeError(CheckpointFormatError):
    """A path in a manifest (or the ``latest`` pointer) would resolve outside the checkpoint directory.

    Attributes:
        field: the manifest field that holds the path.
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field
