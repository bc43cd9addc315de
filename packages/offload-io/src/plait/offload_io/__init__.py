"""plait-offload-io: ZeRO-Offload / ZeRO-Infinity building blocks.

- :class:`AsyncIOEngine` reads and writes tensors to files through worker threads and reusable
  aligned buffers, with O_DIRECT where the filesystem takes it.
- :class:`CpuStateStore` and :class:`FileStateStore` hold groups of state tensors in memory or in
  files, with prefetch and double buffering (the interface plait-zero-sharding plugs into).
- :class:`OffloadedOptimizer` offloads any ``torch.optim`` optimizer's state for single-process
  training.
- :class:`ZeroOffloadPlacement` (:func:`zero_placement`) plugs CPU/NVMe optimizer state, fp32
  masters and (stage 3, ``param_device``) parameter shards into plait-zero-sharding's
  ``zero_shard(..., placement=...)``; :class:`CpuShardStorage` / :class:`FileShardStorage` hold
  the parameter shards.
"""

from plait.offload_io.buffers import BufferPool, aligned_empty, aligned_like
from plait.offload_io.config import IOConfig, OffloadConfig
from plait.offload_io.engine import AsyncIOEngine, IOHandle
from plait.offload_io.errors import OffloadCorruptFileError, OffloadDiskFullError, OffloadIOError
from plait.offload_io.file_store import FileStateStore
from plait.offload_io.optimizer import OffloadedOptimizer
from plait.offload_io.shard_storage import CpuShardStorage, FileShardStorage
from plait.offload_io.store import CpuStateStore, GroupLayout, StateStore, TensorSpec
from plait.offload_io.zero_placement import ZeroOffloadPlacement, zero_placement

__all__ = [
    "AsyncIOEngine",
    "BufferPool",
    "CpuShardStorage",
    "CpuStateStore",
    "FileShardStorage",
    "FileStateStore",
    "GroupLayout",
    "IOConfig",
    "IOHandle",
    "OffloadConfig",
    "OffloadCorruptFileError",
    "OffloadDiskFullError",
    "OffloadIOError",
    "OffloadedOptimizer",
    "StateStore",
    "TensorSpec",
    "ZeroOffloadPlacement",
    "aligned_empty",
    "aligned_like",
    "zero_placement",
]
