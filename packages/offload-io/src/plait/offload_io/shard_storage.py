"""Where ZeRO stage-3 parameter shards live between gathers: ZeRO-Infinity's parameter offload.

plait-zero-sharding's engine takes a :class:`~plait.zero_sharding.extension.ShardStorage` from the
placement (``ZeroOffloadPlacement.shard_storage()``, from ``OffloadConfig.param_device``). It
writes each sharded unit's compute-dtype shard once and frees the shard's memory; before each
all-gather (forward, backward, and a module further ahead as a prefetch) it reads the shard back,
after the gather it frees it again, and after each optimizer step it writes the new values.

* :class:`CpuShardStorage` (``param_device="cpu"``): one host copy per shard, pinned when the
  shard is on CUDA so both copies are asynchronous. On a CPU-only machine this saves nothing
  (the shard was already in host memory); it exists for accelerators and is tested on CPU.
* :class:`FileShardStorage` (``param_device="nvme"``): one file per shard under a fresh
  ``plait-params-*`` directory, through an :class:`~plait.offload_io.engine.AsyncIOEngine`
  (CUDA shards go through its pinned bounce buffers). Space for every shard is checked up front;
  the files are written in place afterwards, so they never grow.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import torch
from torch import Tensor

from plait.offload_io import probe
from plait.offload_io.agreement import raise_together
from plait.offload_io.buffers import aligned_empty, aligned_like
from plait.offload_io.engine import AsyncIOEngine
from plait.offload_io.file_store import discard_directory


class _CudaCopy:
    """A handle for an asynchronous host<->device copy: ``wait`` syncs on its event."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> None:
        self._event.synchronize()


class CpuShardStorage:
    """Shards in host memory (``param_device="cpu"``), one aligned copy per unit key."""

    def __init__(self) -> None:
        self._host: dict[str, Tensor] = {}

    def write(self, key: str, shard: Tensor) -> _CudaCopy | None:
        """Copy ``shard`` to its host copy (allocated on the first write)."""
        host = self._host.get(key)
        if host is None or host.shape != shard.shape or host.dtype != shard.dtype:
            host = self._host[key] = aligned_like(shard, pinned=shard.is_cuda)
        host.copy_(shard.detach(), non_blocking=shard.is_cuda)
        return _CudaCopy() if shard.is_cuda else None

    def read(self, key: str, out: Tensor) -> _CudaCopy | None:
        """Copy the host copy of ``key`` into ``out``."""
        out.copy_(self._host[key], non_blocking=out.is_cuda)
        return _CudaCopy() if out.is_cuda else None

    def discard(self, key: str) -> None:
        """Forget ``key``'s host copy (a construction slice ``zero_shard`` took over)."""
        self._host.pop(key, None)

    def finish_step(self, errors: list[BaseException]) -> None:
        """Host copies do not fail with an I/O error, so no rank can fail alone: no all-reduce
        is needed on this per-step path. Raises a collected error, should one ever exist."""
        if errors:
            raise errors[0]

    @property
    def resident_bytes(self) -> int:
        """Host bytes of the copies."""
        return sum(t.numel() * t.element_size() for t in self._host.values())

    def close(self) -> None:
        """Free the host copies."""
        self._host.clear()


class FileShardStorage:
    """Shards in files (``param_device="nvme"``), one per unit key.

    Args:
        directory: parent directory; a fresh ``plait-<kind>-*`` directory is made inside.
        engine: the I/O engine (the placement shares one with its optimizer-state store and
            closes it).
        kind: ``"params"`` (stage-3 parameter shards) or ``"grads"`` (reduced gradient shards,
            ``OffloadConfig.grad_device="nvme"``); names the directory.

    Raises:
        OffloadIOError: ``directory`` cannot be created or written.
    """

    def __init__(self, directory: str | os.PathLike, *, engine: AsyncIOEngine, kind: str = "params") -> None:
        parent = probe.ensure_directory(os.fspath(directory))
        self.directory = os.path.join(parent, f"plait-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.directory)
        self.engine = engine
        self._files: dict[str, str] = {}
        self._made = 0
        self._closed = False

    def reserve(self, nbytes: int, shards: int) -> None:
        """Check up front that ``shards`` shards of ``nbytes`` in all fit (before the first write).

        Raises:
            OffloadDiskFullError: naming the bytes needed and free and what to change.
        """
        probe.check_space(self.directory + "/params", nbytes + shards * self.engine.config.alignment,
                          min_free_bytes=self.engine.config.min_free_bytes,
                          what=f"{shards} stage-3 parameter shards")

    def empty(self, numel: int, *, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        """Memory for a loaded shard: aligned on the CPU, so O_DIRECT reads and writes go straight
        to it with no bounce copy; a plain device tensor elsewhere (the engine stages it)."""
        if torch.device(device).type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return aligned_empty(numel * itemsize, alignment=self.engine.config.alignment, dtype=dtype)

    def write(self, key: str, shard: Tensor):
        """Start writing ``shard`` to the file of ``key``; returns the engine's handle."""
        path = self._files.get(key)
        if path is None:
            # a counter, not len(self._files): discarded keys must not hand their names out again
            path = self._files[key] = os.path.join(self.directory, f"shard-{self._made}.bin")
            self._made += 1
        return self.engine.write(shard.detach(), path)

    def read(self, key: str, out: Tensor, offset: int = 0):
        """Start reading the file of ``key`` from byte ``offset`` into ``out``; returns the
        engine's handle."""
        return self.engine.read_into(out, self._files[key], offset)

    def finish_step(self, errors: list[BaseException]) -> None:
        """Raise this rank's write failure, or another rank's, on every rank together."""
        raise_together(errors, what="parameter shards", path=self.directory)

    def discard(self, key: str) -> None:
        """Delete ``key``'s file (a construction slice ``zero_shard`` took over); its writes
        were waited by the caller."""
        path = self._files.pop(key, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def file_of(self, key: str) -> str:
        """The file holding ``key``'s shard."""
        return self._files[key]

    def close(self) -> None:
        """Delete the files (the engine is the caller's). Idempotent."""
        if not self._closed:
            self._closed = True
            discard_directory(self.engine, self.directory)


__all__ = ["CpuShardStorage", "FileShardStorage"]
