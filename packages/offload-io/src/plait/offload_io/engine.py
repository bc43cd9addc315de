"""The async tensor I/O engine: tensors to files and back through worker threads.

Layering: a caller's ``write``/``read_into`` validates and plans the operation (space, sizes,
alignment, file descriptors) on its own thread and returns an :class:`IOHandle` at once. A
dispatcher thread cuts operations into ``block_size`` requests and hands them to ``workers``
threads, never more than ``queue_depth`` in flight. Each worker issues one positioned
``pwrite``/``preadv`` per request; CPython releases the GIL inside those calls, so I/O overlaps
with the caller's compute and with the other workers.

A request goes through O_DIRECT when the directory accepts it and the file offset and length are
aligned; it goes straight from the tensor's memory when that is aligned too (tensors from
:func:`~plait.offload_io.buffers.aligned_empty`), else through a pooled bounce buffer. An
unaligned tail goes through an ordinary buffered descriptor. CUDA tensors always go through the
bounce buffers (pinned when CUDA is present).

Durability: with ``IOConfig.fsync`` (the default) a write handle completes after ``fdatasync``,
so a finished write survives a power cut; reads never sync. Writes never truncate a file.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import queue
import threading

import torch

from plait.offload_io import probe
from plait.offload_io.buffers import BufferPool, want_pinned
from plait.offload_io.config import IOConfig
from plait.offload_io.errors import OffloadIOError, wrap_os_error


class IOHandle:
    """The completion of one ``write`` or ``read_into``.

    Attributes:
        kind: ``"write"`` or ``"read"``.
        path: the file.
        nbytes: bytes moved.
        offset: file offset.
    """

    def __init__(self, kind: str, path: str, nbytes: int, offset: int) -> None:
        self.kind = kind
        self.path = path
        self.nbytes = nbytes
        self.offset = offset
        self._event = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation finishes.

        Args:
            timeout: seconds to wait at most; ``None`` waits forever.

        Raises:
            OffloadIOError: the operation failed (an
                :class:`~plait.offload_io.errors.OffloadDiskFullError` when the disk is full).
            TimeoutError: ``timeout`` passed first.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"offload {self.kind} of {self.nbytes} bytes on {self.path} still running after "
                               f"{timeout} s.")
        if self._error is not None:
            raise self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()


class _Operation:
    """One planned write or read: the tensor's bytes, the descriptors, the block count."""

    def __init__(self, kind: str, tensor: torch.Tensor, path: str, offset: int, handle: IOHandle) -> None:
        self.kind = kind
        self.flat = tensor.detach().reshape(-1).view(torch.uint8)
        self.cpu = self.flat.device.type == "cpu"
        self.array = _host_bytes(self.flat) if self.cpu else None
        self.path = path
        self.offset = offset
        self.nbytes = self.flat.numel()
        self.handle = handle
        self.buffered_fd = -1
        self.direct_fd = -1
        self.lock = threading.Lock()
        self.pending = 0
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = error


class AsyncIOEngine:
    """Reads and writes tensors to files asynchronously through reusable aligned buffers.

    Args:
        config: block size, queue depth, workers, O_DIRECT and pinning; defaults when omitted.

    Raises:
        ValueError: ``config.pinned == "on"`` without CUDA.

    Example::

        engine = AsyncIOEngine(IOConfig(block_size=4 << 20, workers=4, queue_depth=8))
        handle = engine.write(tensor, "/nvme/x.bin")
        ...  # compute overlaps with the write
        handle.wait()
        engine.read_into(out, "/nvme/x.bin").wait()
    """

    def __init__(self, config: IOConfig | None = None) -> None:
        self.config = config or IOConfig()
        self.pinned = want_pinned(self.config.pinned)
        self._buffers = BufferPool(self.config.queue_depth, self.config.block_size,
                                   alignment=self.config.alignment, pinned=self.pinned)
        self._slots = threading.Semaphore(self.config.queue_depth)
        self._workers = concurrent.futures.ThreadPoolExecutor(self.config.workers, thread_name_prefix="plait-io")
        self._queue: queue.SimpleQueue[_Operation | None] = queue.SimpleQueue()
        self._outstanding: set[IOHandle] = set()
        self._outstanding_lock = threading.Lock()
        self._closed = False
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="plait-io-dispatch", daemon=True)
        self._dispatcher.start()

    # -- public API -------------------------------------------------------------------------
    def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> IOHandle:
        """Start writing ``tensor``'s bytes to ``path`` at ``offset``.

        The tensor must not be modified until the handle completes.

        Args:
            tensor: a contiguous CPU or CUDA tensor.
            path: the file; created if missing, never truncated.
            offset: byte offset in the file.

        Returns:
            The operation's :class:`IOHandle`.

        Raises:
            ValueError: a non-contiguous tensor or a negative offset.
            OffloadDiskFullError: the filesystem lacks the space (checked before any byte moves).
            OffloadIOError: the file cannot be opened, or O_DIRECT is ``"on"`` and refused.
        """
        path = os.fspath(path)
        op = self._plan("write", tensor, path, offset)
        grow = op.offset + op.nbytes - probe.file_size(path)
        probe.check_space(path, grow, min_free_bytes=self.config.min_free_bytes,
                          what=f"offload write of {op.nbytes} bytes")
        return self._submit(op, os.O_WRONLY | os.O_CREAT)

    def read_into(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> IOHandle:
        """Start reading ``tensor.numel() * element_size`` bytes of ``path`` at ``offset`` into ``tensor``.

        The tensor must not be used until the handle completes.

        Args:
            tensor: a contiguous CPU or CUDA tensor to fill.
            path: the file.
            offset: byte offset in the file.

        Returns:
            The operation's :class:`IOHandle`.

        Raises:
            ValueError: a non-contiguous tensor or a negative offset.
            OffloadCorruptFileError: the file is missing or too short.
        """
        path = os.fspath(path)
        op = self._plan("read", tensor, path, offset)
        probe.check_readable(path, op.offset, op.nbytes)
        return self._submit(op, os.O_RDONLY)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every outstanding operation; raise the first failure among them.

        Args:
            timeout: seconds per operation at most.

        Raises:
            OffloadIOError: an operation failed.
        """
        with self._outstanding_lock:
            handles = list(self._outstanding)
        first: BaseException | None = None
        for handle in handles:
            try:
                handle.wait(timeout)
            except (OSError, TimeoutError) as exc:  # keep waiting for the rest: no worker may touch freed memory
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for outstanding work, then stop the threads. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._queue.put(None)
            self._dispatcher.join()
            self._workers.shutdown(wait=True)

    def __enter__(self) -> AsyncIOEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of bounce buffers allocated so far."""
        return self._buffers.allocated_bytes

    # -- planning ---------------------------------------------------------------------------
    def _plan(self, kind: str, tensor: torch.Tensor, path: str, offset: int) -> _Operation:
        if self._closed:
            raise RuntimeError("AsyncIOEngine is closed; create a new one.")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"offload {kind} needs a torch.Tensor, got {type(tensor).__name__}.")
        if not tensor.is_contiguous():
            raise ValueError(f"offload {kind} of a non-contiguous tensor (shape {tuple(tensor.shape)}); "
                             "pass tensor.contiguous().")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"offload {kind}: tensors on {tensor.device} are not supported; use CPU or CUDA.")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offload {kind}: offset={offset!r} must be an int >= 0.")
        handle = IOHandle(kind, path, tensor.numel() * tensor.element_size(), offset)
        return _Operation(kind, tensor, path, offset, handle)

    def _use_direct(self, path: str) -> bool:
        setting = self.config.use_o_direct
        if setting == "off":
            return False
        directory = os.path.dirname(os.path.abspath(path)) or "."
        supported = probe.o_direct_supported(directory, self.config.alignment)
        if setting == "on" and not supported:
            raise OffloadIOError(errno.EINVAL, f"use_o_direct='on' but {directory} does not accept O_DIRECT "
                                 "(an older tmpfs, a network or overlay filesystem?); "
                                 "set use_o_direct='auto' or 'off'.", path=path)
        return supported

    def _submit(self, op: _Operation, flags: int) -> IOHandle:
        try:
            op.buffered_fd = os.open(op.path, flags, 0o644)
            if op.nbytes and op.offset % self.config.alignment == 0 and self._use_direct(op.path):
                op.direct_fd = os.open(op.path, flags | probe.O_DIRECT, 0o644)
        except OSError as exc:
            self._close_fds(op)
            if isinstance(exc, OffloadIOError):
                raise
            raise wrap_os_error(exc, path=op.path, nbytes=op.nbytes, offset=op.offset, action=op.kind) from exc
        with self._outstanding_lock:
            self._outstanding.add(op.handle)
        self._queue.put(op)
        return op.handle

    # -- the dispatcher and the workers -----------------------------------------------------
    def _dispatch_loop(self) -> None:
        while (op := self._queue.get()) is not None:
            block = self.config.block_size
            starts = list(range(0, op.nbytes, block))
            if not starts:
                self._complete(op)
                continue
            op.pending = len(starts)
            for start in starts:
                self._slots.acquire()
                self._workers.submit(self._run_block, op, start, min(block, op.nbytes - start))

    def _run_block(self, op: _Operation, start: int, length: int) -> None:
        try:
            if op.error is None:
                self._move(op, start, length)
        except OSError as exc:
            op.fail(exc if isinstance(exc, OffloadIOError)
                    else wrap_os_error(exc, path=op.path, nbytes=op.nbytes, offset=op.offset, action=op.kind))
        except BaseException as exc:  # noqa: BLE001 - a bug must still complete the handle, not hang the caller
            op.fail(exc)
        finally:
            self._slots.release()
            with op.lock:
                op.pending -= 1
                last = op.pending == 0
            if last:
                self._complete(op)

    def _complete(self, op: _Operation) -> None:
        try:
            if op.kind == "write" and op.error is None and self.config.fsync and op.nbytes:
                os.fdatasync(op.buffered_fd)
        except OSError as exc:
            op.fail(wrap_os_error(exc, path=op.path, nbytes=op.nbytes, offset=op.offset, action="fsync"))
        finally:
            self._close_fds(op)
            # A finished operation must not pin its tensor: the dispatcher's loop variable keeps
            # the last one until the next arrives, which held a whole written shard (125 MiB of
            # a 32000 x 1024 head) in memory after the engine had freed it.
            op.flat = op.array = None
            with self._outstanding_lock:
                self._outstanding.discard(op.handle)
            op.handle._finish(op.error)

    @staticmethod
    def _close_fds(op: _Operation) -> None:
        for fd in (op.buffered_fd, op.direct_fd):
            if fd >= 0:
                os.close(fd)
        op.buffered_fd = op.direct_fd = -1

    def _move(self, op: _Operation, start: int, length: int) -> None:
        align = self.config.alignment
        file_offset = op.offset + start
        direct_len = length - length % align if op.direct_fd >= 0 and file_offset % align == 0 else 0
        if direct_len:
            try:
                self._request(op, op.direct_fd, start, direct_len, aligned_fd=True)
            except OSError as exc:
                # "auto" trusts the probe, but a filesystem may still refuse one request (EINVAL);
                # redo it buffered rather than fail the step.
                if exc.errno != errno.EINVAL or self.config.use_o_direct == "on":
                    raise
                self._request(op, op.buffered_fd, start, direct_len, aligned_fd=False)
        if direct_len < length:
            self._request(op, op.buffered_fd, start + direct_len, length - direct_len, aligned_fd=False)

    def _request(self, op: _Operation, fd: int, start: int, length: int, *, aligned_fd: bool) -> None:
        zero_copy = op.cpu and (not aligned_fd or (op.flat.data_ptr() + start) % self.config.alignment == 0)
        if zero_copy:
            _transfer(op.kind, fd, op.array[start:start + length], op.offset + start, op.path)
            return
        buffer = self._buffers.acquire()
        try:
            staged = buffer[:length]
            if op.kind == "write":
                staged.copy_(op.flat[start:start + length])
                _transfer("write", fd, staged.numpy(), op.offset + start, op.path)
            else:
                _transfer("read", fd, staged.numpy(), op.offset + start, op.path)
                op.flat[start:start + length].copy_(staged)
        finally:
            self._buffers.release(buffer)


def _host_bytes(flat: torch.Tensor) -> memoryview:
    """A writable byte view of a CPU tensor's memory for ``pwrite``/``preadv``. Built with ctypes,
    not ``Tensor.numpy()``: numpy sharing marks the tensor's storage as never resizable again,
    and plait-zero-sharding reads offloaded shards straight into gathered buffers whose storage it
    resizes to zero between uses. The operation keeps ``flat`` alive while the view is in use."""
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())).cast("B")


def _transfer(kind: str, fd: int, array, file_offset: int, path: str) -> None:
    """Move all of ``array`` to/from ``fd`` at ``file_offset``, continuing after short transfers."""
    view = memoryview(array).cast("B")
    done = 0
    total = len(view)
    while done < total:
        if kind == "write":
            moved = os.pwrite(fd, view[done:], file_offset + done)
        else:
            moved = os.preadv(fd, [view[done:]], file_offset + done)
        if moved == 0:
            # A zero-length write would loop forever; a zero-length read is end of file.
            raise OSError(errno.EIO, f"{kind} made no progress at offset {file_offset + done} of {path}")
        done += moved
