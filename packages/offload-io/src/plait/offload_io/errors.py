"""Typed errors of plait-offload-io.

Every I/O failure the engine or a state store sees is re-raised as one of these, carrying the
path and the byte counts involved, so a caller (or a ZeRO rank agreeing on failure with its
peers) can tell "the disk is full" from "the file is damaged" without parsing strings. They
subclass :class:`OSError` and keep ``errno``, so code that already catches ``OSError`` keeps
working.
"""

from __future__ import annotations

import errno as errno_mod
import os

# EFBIG is what a write past RLIMIT_FSIZE (or the filesystem's largest file) returns; EDQUOT is a
# quota. To the user all three mean the same thing: this path cannot take these bytes.
DISK_FULL_ERRNOS = frozenset({errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG})


class OffloadIOError(OSError):
    """An offload read or write failed.

    Attributes:
        path: the file involved.
        nbytes: bytes the operation wanted to move.
        offset: the file offset of the operation.
    """

    def __init__(self, errno: int, message: str, *, path: str, nbytes: int = 0, offset: int = 0) -> None:
        super().__init__(errno, message, path)
        self.path = path
        self.nbytes = nbytes
        self.offset = offset

    def __str__(self) -> str:
        return self.strerror or ""

    def __reduce__(self):
        # Keeps the keyword-only fields when the error crosses a process boundary (multiprocessing).
        return (_rebuild, (type(self), self.errno, self.strerror, self.path, self.nbytes, self.offset))


class OffloadDiskFullError(OffloadIOError):
    """The target filesystem cannot take the bytes (ENOSPC, EDQUOT or EFBIG).

    Raised up front when ``shutil.disk_usage`` already shows too little space, and during a run
    when a write fails for lack of space. Files written before the failure are untouched; the
    failed write's in-memory source is kept, so the same write can be retried once space is back.
    """


class OffloadCorruptFileError(OffloadIOError):
    """A file holds fewer bytes than the read expects (truncated, replaced, or never written)."""


def _rebuild(cls, errno, message, path, nbytes, offset):
    return cls(errno, message, path=path, nbytes=nbytes, offset=offset)


def wrap_os_error(exc: OSError, *, path: str, nbytes: int, offset: int, action: str) -> OffloadIOError:
    """Turn a raw ``OSError`` from a read or write into a typed, explained error.

    Args:
        exc: the error raised by ``os.pwrite``/``os.preadv``/``os.open``.
        path: the file.
        nbytes: bytes of the whole operation.
        offset: its file offset.
        action: ``"write"`` or ``"read"``.

    Returns:
        An :class:`OffloadDiskFullError` for ENOSPC/EDQUOT/EFBIG, else an :class:`OffloadIOError`.
    """
    code = exc.errno or errno_mod.EIO
    reason = os.strerror(code)
    if code in DISK_FULL_ERRNOS:
        message = (
            f"offload {action} of {nbytes} bytes at offset {offset} to {path} failed: {reason}. "
            "Free space on that filesystem, point the offload path at a larger one, "
            "or keep the state in CPU memory (device='cpu')."
        )
        return OffloadDiskFullError(code, message, path=path, nbytes=nbytes, offset=offset)
    message = f"offload {action} of {nbytes} bytes at offset {offset} on {path} failed: {reason}."
    if code == errno_mod.EINVAL:
        message += " If this filesystem rejects O_DIRECT, set use_o_direct='off' (or 'auto')."
    return OffloadIOError(code, message, path=path, nbytes=nbytes, offset=offset)
