"""Durable file writes and chunk hashing: the only place that touches bytes on disk.

Durability follows the POSIX recipe: write, ``fsync`` the file, ``fsync`` its directory so the
name itself is durable, and make anything visible only through ``os.replace``/``os.rename``,
which is atomic within one filesystem. Hashing runs on a helper thread while the main thread
writes, because hashlib releases the GIL on large buffers: on a two-core machine the hash then
costs almost nothing next to the write and its fsync.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from plait.universal_ckpt.errors import CheckpointIntegrityError

# Writes go out in blocks so a full disk is noticed early and the hash thread can keep pace.
WRITE_BLOCK = 8 << 20


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, row-major, without copying when it is already contiguous."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def chunk_hashes(data: memoryview, chunk_bytes: int, algorithm: str = "sha256") -> tuple[str, ...]:
    """Digests of consecutive ``chunk_bytes`` chunks of ``data`` (one digest for empty data)."""
    if len(data) == 0:
        return (hashlib.new(algorithm, b"").hexdigest(),)
    return tuple(hashlib.new(algorithm, data[start:start + chunk_bytes]).hexdigest()
                 for start in range(0, len(data), chunk_bytes))


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` durable (a rename is only durable after this)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pieces(path: Path, pieces: Iterable[memoryview], *, chunk_bytes: int,
                 algorithm: str = "sha256") -> list[tuple[int, int, tuple[str, ...]]]:
    """Write buffers back to back into a new file, hash each in chunks, fsync.

    Args:
        path: the file to create (must not exist).
        pieces: the buffers, written in order with no padding.
        chunk_bytes: hash chunk size.
        algorithm: hashlib algorithm name.

    Returns:
        ``(offset, nbytes, hashes)`` per buffer.

    Raises:
        OSError: the write or fsync failed (ENOSPC, EFBIG, EIO, ...).
    """
    records: list[tuple[int, int, tuple[str, ...]]] = []
    futures = []
    offset = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-ckpt-hash") as pool:
        with open(path, "xb", buffering=0) as file:
            for data in pieces:
                futures.append(pool.submit(chunk_hashes, data, chunk_bytes, algorithm))
                for start in range(0, len(data), WRITE_BLOCK):
                    _write_all(file, data[start:start + WRITE_BLOCK])
                records.append((offset, len(data), ()))
                offset += len(data)
            os.fsync(file.fileno())
        hashes = [future.result() for future in futures]
    return [(off, n, h) for (off, n, _), h in zip(records, hashes)]


def _write_all(file, data: memoryview) -> None:
    while len(data):
        written = file.write(data)
        data = data[written:]


def write_durable(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data`` and fsync it (the caller fsyncs the directory)."""
    with open(path, "xb", buffering=0) as file:
        _write_all(file, memoryview(data))
        os.fsync(file.fileno())


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        tmp.unlink()
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """Digest of a whole file."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, algorithm).hexdigest()


def read_verified(path: Path, rel: str, offset: int, nbytes: int, *, start: int, stop: int,
                  hashes: tuple[str, ...] | None, chunk_bytes: int, algorithm: str = "sha256",
                  into: memoryview | None = None) -> memoryview:
    """Read bytes ``[start, stop)`` of a piece stored at ``offset`` of ``path``, checking hashes.

    With ``hashes`` the read widens to whole chunks and every chunk is checked; without, exactly
    ``[start, stop)`` is read.

    Args:
        path: the data file.
        rel: the file's name relative to the checkpoint, for error messages.
        offset, nbytes: where the piece lies in the file and its size.
        start, stop: the byte range of the piece wanted.
        hashes: the piece's chunk digests, or None to skip verification.
        chunk_bytes: chunk size of ``hashes``.
        algorithm: hashlib algorithm name.
        into: optional writable buffer of ``stop - start`` bytes to fill; when the wanted range is
            already chunk-aligned the file is read straight into it (no extra copy).

    Returns:
        The bytes of ``[start, stop)`` (a view of ``into`` when given).

    Raises:
        CheckpointIntegrityError: the file is missing or short, or a chunk digest differs.
    """
    lo, hi = start, stop
    if hashes is not None:
        lo = (start // chunk_bytes) * chunk_bytes
        hi = min(nbytes, -(-stop // chunk_bytes) * chunk_bytes) if nbytes else 0
    direct = into is not None and lo == start and hi == stop
    buffer = into if direct else bytearray(hi - lo)
    try:
        with open(path, "rb", buffering=0) as file:
            file.seek(offset + lo)
            got = file.readinto(buffer)
            while got < len(buffer):
                more = file.readinto(memoryview(buffer)[got:])
                if not more:
                    break
                got += more
    except FileNotFoundError as exc:
        raise CheckpointIntegrityError(f"checkpoint file {rel} is missing.", file=rel,
                                       expected="present", actual="missing") from exc
    if got < len(buffer):
        raise CheckpointIntegrityError(
            f"checkpoint file {rel} is truncated: needed bytes up to {offset + hi}, file ends at {offset + lo + got}.",
            file=rel, expected=f">= {offset + hi} bytes", actual=f"{offset + lo + got} bytes")
    if hashes is not None:
        view = memoryview(buffer)
        for index in range(lo // chunk_bytes if nbytes else 0, -(-hi // chunk_bytes) if nbytes else 1):
            begin = index * chunk_bytes - lo
            actual = hashlib.new(algorithm, view[begin:begin + chunk_bytes]).hexdigest()
            if actual != hashes[index]:
                raise CheckpointIntegrityError(
                    f"checkpoint file {rel}: {algorithm} of bytes {offset + index * chunk_bytes}.."
                    f"{offset + min(nbytes, (index + 1) * chunk_bytes)} expected {hashes[index]}, actual {actual}.",
                    file=rel, expected=hashes[index], actual=actual)
    wanted = memoryview(buffer)[start - lo:stop - lo]  # a view: no second copy of the bytes
    if into is not None and not direct:
        into[:] = wanted
        return into
    return wanted
