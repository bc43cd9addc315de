"""Durable file writes and chunk hashing: the only place that touches bytes on disk.

Durability follows the POSIX recipe: write, ``fsync`` the file, ``fsync`` its directory so the
name itself is durable, and make anything visible only through ``os.replace``/``os.rename``,
which is atomic within one filesystem. Hashing runs on a helper thread while the main thread
writes, because hashlib releases the GIL on large buffers: on a two-core machine the hash then
costs almost nothing next to the write and its fsync.

Every chunk gets two digests: the format's sha256 (``hashes``; what ``plait ckpt verify`` checks
and what every reader of format 1 knows) and, when the ``xxhash`` package is importable, an
XXH3-64 checksum (``checksums``) that loads check instead: about 30 GB/s against sha256's 2 GB/s
here, so checking every byte costs less than copying it. Both catch accidental damage (a flipped
bit, a torn or truncated write); neither is a signature, since the manifest that holds them lies
beside the data.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from plait.universal_ckpt.errors import CheckpointIntegrityError

try:  # a declared dependency; a reader without it falls back to the sha256 digests
    import xxhash
except ImportError:  # pragma: no cover - environments installed with --no-deps
    xxhash = None

CHECKSUM_ALGORITHM = "xxh3_64"

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


def chunk_checksums(data: memoryview, chunk_bytes: int) -> tuple[str, ...] | None:
    """XXH3-64 checksums of the same chunks as :func:`chunk_hashes`, or None without ``xxhash``."""
    if xxhash is None:
        return None
    if len(data) == 0:
        return (xxhash.xxh3_64_hexdigest(b""),)
    return tuple(xxhash.xxh3_64_hexdigest(data[start:start + chunk_bytes])
                 for start in range(0, len(data), chunk_bytes))


def chunk_digests(data: memoryview, chunk_bytes: int,
                  algorithm: str = "sha256") -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """``(hashes, checksums)`` of ``data``'s chunks: what a piece record stores."""
    return chunk_hashes(data, chunk_bytes, algorithm), chunk_checksums(data, chunk_bytes)


def digest(algorithm: str, data: memoryview) -> str:
    """Hex digest of ``data`` with ``algorithm``: a hashlib name or :data:`CHECKSUM_ALGORITHM`."""
    if algorithm == CHECKSUM_ALGORITHM:
        return xxhash.xxh3_64_hexdigest(data)
    return hashlib.new(algorithm, data).hexdigest()


def pick_digests(hashes: tuple[str, ...], checksums: tuple[str, ...] | None,
                 hash_algorithm: str) -> tuple[tuple[str, ...], str]:
    """The digests a load checks: the fast checksums when stored and computable, else the hashes."""
    if checksums is not None and xxhash is not None:
        return checksums, CHECKSUM_ALGORITHM
    return hashes, hash_algorithm


def check_chunks(view: memoryview, rel: str, offset: int, nbytes: int, lo: int, hi: int, *,
                 digests: tuple[str, ...], chunk_bytes: int, algorithm: str) -> None:
    """Check the chunks of a piece that ``view`` (the piece's bytes ``[lo, hi)``, chunk-aligned) holds.

    Raises:
        CheckpointIntegrityError: naming the file, the byte range, the expected and the actual digest.
    """
    for index in range(lo // chunk_bytes if nbytes else 0, -(-hi // chunk_bytes) if nbytes else 1):
        begin = index * chunk_bytes - lo
        actual = digest(algorithm, view[begin:begin + chunk_bytes])
        if actual != digests[index]:
            raise CheckpointIntegrityError(
                f"checkpoint file {rel}: {algorithm} of bytes {offset + index * chunk_bytes}.."
                f"{offset + min(nbytes, (index + 1) * chunk_bytes)} expected {digests[index]}, actual {actual}.",
                file=rel, expected=digests[index], actual=actual)


def chunk_bounds(start: int, stop: int, nbytes: int, chunk_bytes: int) -> tuple[int, int]:
    """``[start, stop)`` of a piece widened to whole chunks (the bytes a checked read must touch)."""
    lo = (start // chunk_bytes) * chunk_bytes
    hi = min(nbytes, -(-stop // chunk_bytes) * chunk_bytes) if nbytes else 0
    return lo, hi


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` durable (a rename is only durable after this)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pieces(path: Path, pieces: Iterable[memoryview], *, chunk_bytes: int,
                 algorithm: str = "sha256") -> list[tuple[int, int, tuple[str, ...], tuple[str, ...] | None]]:
    """Write buffers back to back into a new file, hash (and checksum) each in chunks, fsync.

    Args:
        path: the file to create (must not exist).
        pieces: the buffers, written in order with no padding.
        chunk_bytes: hash chunk size.
        algorithm: hashlib algorithm name.

    Returns:
        ``(offset, nbytes, hashes, checksums)`` per buffer (``checksums`` None without ``xxhash``).

    Raises:
        OSError: the write or fsync failed (ENOSPC, EFBIG, EIO, ...).
    """
    records: list[tuple[int, int]] = []
    futures = []
    offset = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-ckpt-hash") as pool:
        with open(path, "xb", buffering=0) as file:
            for data in pieces:
                futures.append(pool.submit(chunk_digests, data, chunk_bytes, algorithm))
                for start in range(0, len(data), WRITE_BLOCK):
                    _write_all(file, data[start:start + WRITE_BLOCK])
                records.append((offset, len(data)))
                offset += len(data)
            os.fsync(file.fileno())
        digests = [future.result() for future in futures]
    return [(off, n, h, c) for (off, n), (h, c) in zip(records, digests)]


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

    With ``hashes`` every chunk the range touches is read whole and checked right after it is
    read, while it is still in cache: a chunk wholly inside the range is read straight into the
    destination, only the partial chunks at its ends go through a scratch buffer. Without, exactly
    ``[start, stop)`` is read, straight into the destination.

    Args:
        path: the data file.
        rel: the file's name relative to the checkpoint, for error messages.
        offset, nbytes: where the piece lies in the file and its size.
        start, stop: the byte range of the piece wanted.
        hashes: the piece's chunk digests, or None to skip verification.
        chunk_bytes: chunk size of ``hashes``.
        algorithm: their algorithm (a hashlib name or :data:`CHECKSUM_ALGORITHM`).
        into: optional writable buffer of ``stop - start`` bytes to fill (the destination);
            without it a new buffer is.

    Returns:
        The bytes of ``[start, stop)`` (``into`` itself when given).

    Raises:
        CheckpointIntegrityError: the file is missing or short, or a chunk digest differs.
    """
    out = memoryview(into if into is not None else bytearray(stop - start)).cast("B")
    try:
        with open(path, "rb", buffering=0) as file:
            if hashes is None:
                _read_exactly(file, rel, offset, start, out)
                return out
            lo, hi = chunk_bounds(start, stop, nbytes, chunk_bytes)
            scratch = None
            for begin in range(lo, hi, chunk_bytes) if hi > lo else (lo,):
                end = min(hi, begin + chunk_bytes)
                direct = start <= begin and end <= stop  # a whole chunk wanted: read it into its place
                if direct:
                    chunk = out[begin - start:end - start]
                else:  # an end of the range: read the whole chunk aside, keep the wanted part
                    scratch = scratch if scratch is not None and len(scratch) >= end - begin else bytearray(end - begin)
                    chunk = memoryview(scratch)[:end - begin]
                _read_exactly(file, rel, offset, begin, chunk)
                check_chunks(chunk, rel, offset, nbytes, begin, end, digests=hashes, chunk_bytes=chunk_bytes,
                             algorithm=algorithm)
                if not direct:
                    keep_lo, keep_hi = max(begin, start), min(end, stop)
                    out[keep_lo - start:keep_hi - start] = chunk[keep_lo - begin:keep_hi - begin]
    except FileNotFoundError as exc:
        raise CheckpointIntegrityError(f"checkpoint file {rel} is missing.", file=rel,
                                       expected="present", actual="missing") from exc
    return out


def _read_exactly(file, rel: str, offset: int, at: int, buffer: memoryview) -> None:
    """Fill ``buffer`` from byte ``offset + at`` of ``file``, or say the file is truncated."""
    file.seek(offset + at)
    got = 0
    while got < len(buffer):
        more = file.readinto(buffer[got:])
        if not more:
            raise CheckpointIntegrityError(
                f"checkpoint file {rel} is truncated: needed bytes up to {offset + at + len(buffer)}, "
                f"file ends at {offset + at + got}.", file=rel, expected=f">= {offset + at + len(buffer)} bytes",
                actual=f"{offset + at + got} bytes")
        got += more
