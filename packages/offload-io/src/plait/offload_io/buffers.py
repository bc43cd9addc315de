"""Aligned (and, with CUDA, page-locked) host memory, and a pool that reuses it.

O_DIRECT needs the buffer address, the length and the file offset aligned to the device's
logical block. torch's CPU allocator only promises 64-byte alignment, so :func:`aligned_empty`
over-allocates a byte tensor by one alignment unit and slices at the first aligned address.
The slice keeps the whole allocation alive through its storage, so there is no lifetime to
manage. A tensor allocated this way can be written with O_DIRECT straight from its memory
(no bounce copy); the state stores allocate their slots like that.
"""

from __future__ import annotations

import queue
import threading

import torch

from plait.offload_io.config import DEFAULT_ALIGNMENT


def want_pinned(setting: str) -> bool:
    """Resolve an ``"auto"/"on"/"off"`` pinned setting against this machine.

    Args:
        setting: the :class:`~plait.offload_io.config.IOConfig` ``pinned`` value.

    Returns:
        Whether to page-lock host buffers.

    Raises:
        ValueError: ``"on"`` without CUDA (page-locking needs the CUDA driver).
    """
    if setting == "off":
        return False
    available = torch.cuda.is_available()
    if setting == "on" and not available:
        raise ValueError("IOConfig.pinned='on' needs CUDA, which is not available; use pinned='auto' or 'off'.")
    return available


def aligned_empty(
    nbytes: int, *, alignment: int = DEFAULT_ALIGNMENT, pinned: bool = False, dtype: torch.dtype = torch.uint8
) -> torch.Tensor:
    """Allocate an uninitialised 1-D CPU tensor whose first byte is ``alignment``-aligned.

    Args:
        nbytes: size in bytes; must be a multiple of ``dtype``'s item size.
        alignment: the address alignment (a power of two).
        pinned: page-lock the memory (needs CUDA).
        dtype: element type of the returned view.

    Returns:
        A 1-D tensor of ``nbytes // itemsize`` elements.

    Raises:
        ValueError: ``nbytes`` is negative or not a multiple of the item size.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"aligned_empty: nbytes={nbytes} must be >= 0 and a multiple of {dtype}'s {itemsize} bytes.")
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pinned)
    shift = (-raw.data_ptr()) % alignment
    view = raw[shift:shift + nbytes]
    assert view.data_ptr() % alignment == 0
    return view.view(dtype)


def aligned_like(tensor: torch.Tensor, *, alignment: int = DEFAULT_ALIGNMENT, pinned: bool = False) -> torch.Tensor:
    """An uninitialised aligned CPU tensor with ``tensor``'s shape and dtype.

    Args:
        tensor: the template.
        alignment: the address alignment.
        pinned: page-lock the memory.

    Returns:
        The new tensor (contiguous).
    """
    flat = aligned_empty(tensor.numel() * tensor.element_size(), alignment=alignment, pinned=pinned,
                         dtype=tensor.dtype)
    return flat.view(tensor.shape)


def is_aligned(address: int, alignment: int) -> bool:
    """Whether ``address`` is a multiple of ``alignment``."""
    return address % alignment == 0


class BufferPool:
    """A fixed set of equal-sized aligned byte buffers, lent one at a time.

    The engine takes a buffer to stage a block that cannot go to disk from its own memory (an
    unaligned or CUDA source) and gives it back when the request completes, so steady-state I/O
    allocates nothing. Buffers are allocated lazily, up to ``count``.

    Args:
        count: most buffers alive at once.
        nbytes: size of each buffer.
        alignment: address alignment.
        pinned: page-lock the buffers.
    """

    def __init__(self, count: int, nbytes: int, *, alignment: int = DEFAULT_ALIGNMENT, pinned: bool = False) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"BufferPool: count={count} and nbytes={nbytes} must both be >= 1.")
        self.count = count
        self.nbytes = nbytes
        self.alignment = alignment
        self.pinned = pinned
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._allocated = 0
        self._lock = threading.Lock()
        self._available = threading.Semaphore(count)

    def acquire(self) -> torch.Tensor:
        """Take a buffer, waiting while all ``count`` are lent out.

        Returns:
            A 1-D aligned uint8 tensor of ``nbytes`` bytes.
        """
        self._available.acquire()
        try:
            return self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                self._allocated += 1
            return aligned_empty(self.nbytes, alignment=self.alignment, pinned=self.pinned)

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer back to the pool."""
        self._free.put(buffer)
        self._available.release()

    @property
    def allocated_bytes(self) -> int:
        """Bytes the pool has allocated so far (its share of resident memory)."""
        return self._allocated * (self.nbytes + self.alignment)
