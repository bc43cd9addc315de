"""Up-front checks on a directory: does it take O_DIRECT, and has it room for a planned write.

Both are asked once per directory (O_DIRECT) or once per write (space) *before* any worker
touches the file, so the user gets an error naming the path and the fix instead of a failure in
a background thread halfway through a step.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile

from plait.offload_io.buffers import aligned_empty
from plait.offload_io.errors import OffloadCorruptFileError, OffloadDiskFullError, OffloadIOError

O_DIRECT = getattr(os, "O_DIRECT", 0)


@functools.lru_cache(maxsize=256)
def o_direct_supported(directory: str, alignment: int) -> bool:
    """Whether files in ``directory`` accept an aligned O_DIRECT write and read.

    tmpfs before Linux 6.6, overlayfs on some kernels and most network filesystems refuse ``open(O_DIRECT)`` with
    EINVAL; others accept the open and refuse the I/O. The probe writes and reads one aligned
    block of a temporary file, so both cases are caught. The answer is cached per directory.

    Args:
        directory: an existing directory.
        alignment: the request alignment to try.

    Returns:
        True when O_DIRECT works there.
    """
    if not O_DIRECT:
        return False
    block = aligned_empty(alignment)
    block.fill_(0x5A)
    fd = -1
    name = ""
    try:
        handle, name = tempfile.mkstemp(prefix=".plait-odirect-", dir=directory)
        os.close(handle)
        fd = os.open(name, os.O_RDWR | O_DIRECT)
        view = block.numpy()
        if os.pwrite(fd, view, 0) != alignment:
            return False
        back = aligned_empty(alignment)
        return os.preadv(fd, [back.numpy()], 0) == alignment and bool((back == 0x5A).all())
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        if name:
            try:
                os.unlink(name)
            except OSError:
                pass


def free_bytes(directory: str) -> int:
    """Free bytes on the filesystem holding ``directory`` (for an unprivileged writer)."""
    return shutil.disk_usage(directory).free


def check_space(path: str, planned_bytes: int, *, min_free_bytes: int, what: str = "write") -> None:
    """Refuse a write that the filesystem cannot take, before it starts.

    Args:
        path: the file to be written (its directory must exist).
        planned_bytes: bytes the write adds to the filesystem (growth of the file, not rewrites).
        min_free_bytes: space to leave free.
        what: a few words for the message, e.g. ``"optimizer state of 12 groups"``.

    Raises:
        OffloadDiskFullError: ``planned_bytes + min_free_bytes`` exceeds the free space; the
            message gives both numbers and what to change.
        OffloadIOError: the directory does not exist or cannot be queried.
    """
    if planned_bytes <= 0:
        return
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        available = free_bytes(directory)
    except OSError as exc:
        raise OffloadIOError(exc.errno or errno.EIO, f"{what}: cannot use {directory}: {exc.strerror} "
                             "(create the directory first, or choose another path).", path=path) from exc
    if planned_bytes + min_free_bytes > available:
        raise OffloadDiskFullError(
            errno.ENOSPC,
            f"{what} needs {planned_bytes} bytes at {directory} (plus min_free_bytes={min_free_bytes} kept free) "
            f"but only {available} bytes are free. Free space there, choose a path on a larger filesystem, "
            "lower min_free_bytes, or keep the state in CPU memory (device='cpu').",
            path=path,
            nbytes=planned_bytes,
        )


def file_size(path: str) -> int:
    """Size of ``path`` in bytes, 0 when it does not exist."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def check_readable(path: str, offset: int, nbytes: int) -> None:
    """Refuse a read that runs past the end of ``path``.

    Args:
        path: the file to read.
        offset: where the read starts.
        nbytes: how many bytes it wants.

    Raises:
        OffloadCorruptFileError: the file is missing or shorter than ``offset + nbytes``.
    """
    try:
        size = os.stat(path).st_size
    except FileNotFoundError as exc:
        raise OffloadCorruptFileError(
            errno.ENOENT, f"offload read of {nbytes} bytes from {path}: the file does not exist.",
            path=path, nbytes=nbytes, offset=offset,
        ) from exc
    if size < offset + nbytes:
        raise OffloadCorruptFileError(
            errno.EIO,
            f"offload read of {nbytes} bytes at offset {offset} from {path}: the file holds only {size} bytes "
            "(truncated, or written by a different layout).",
            path=path, nbytes=nbytes, offset=offset,
        )


def ensure_directory(directory: str) -> str:
    """Create ``directory`` if needed and check that it is writable.

    Args:
        directory: the offload directory.

    Returns:
        Its absolute path.

    Raises:
        OffloadIOError: it cannot be created or is not writable.
    """
    absolute = os.path.abspath(directory)
    try:
        os.makedirs(absolute, exist_ok=True)
    except OSError as exc:
        raise OffloadIOError(exc.errno or errno.EIO, f"cannot create offload directory {absolute}: {exc.strerror}.",
                             path=absolute) from exc
    if not os.access(absolute, os.W_OK):
        raise OffloadIOError(errno.EACCES, f"offload directory {absolute} is not writable; choose another path.",
                             path=absolute)
    return absolute
