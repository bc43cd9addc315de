"""``plait io bench``: find the best block size, queue depth and workers for a path.

Each setting writes (with fsync) and reads back (cold) the same bytes as a raw sequential
``os.write``/``os.readv`` loop, alternating with it in the same run, so every row is a ratio
against the raw peer measured next to it. The peers live here too (the suite uses them): what a
user would write by hand, one sequential ``os.write`` loop plus ``fsync`` and one sequential
``os.readv`` loop, and ``torch.save``/``torch.load``. Reads are measured cold: before each read
the file's pages are evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)``, which works without
privileges (after ``fsync`` the pages are clean, so the kernel drops them).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
import uuid

import torch

from plait.offload_io.buffers import aligned_empty
from plait.offload_io.config import MIB, IOConfig
from plait.offload_io.engine import AsyncIOEngine
from plait.offload_io.probe import check_space, ensure_directory, o_direct_supported

RAW_CHUNK = 64 << 20  # one os.write per 64 MiB: large enough that syscall count is not the limit


def evict(path: str) -> bool:
    """Drop ``path``'s clean pages from the page cache so the next read goes to the device.

    Args:
        path: the file.

    Returns:
        True when the kernel accepted the advice.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def raw_write(data: torch.Tensor, path: str) -> float:
    """Sequential ``os.write`` of ``data``'s bytes to a fresh ``path`` plus ``fsync``; returns seconds."""
    view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:done + RAW_CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_read(out: torch.Tensor, path: str) -> float:
    """Sequential ``os.readv`` of ``path`` into ``out``; returns seconds."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.readv(fd, [view[done:done + RAW_CHUNK]])
            if got == 0:
                raise OSError(f"{path} ended after {done} bytes")
            done += got
    finally:
        os.close(fd)
    return time.perf_counter() - start


def engine_write(engine: AsyncIOEngine, data: torch.Tensor, path: str) -> float:
    """Write ``data`` to a fresh ``path`` through ``engine`` and wait (fsync per its config); seconds."""
    if os.path.exists(path):
        os.unlink(path)  # the raw peer truncates; start both from an empty file
    start = time.perf_counter()
    engine.write(data, path).wait()
    return time.perf_counter() - start


def engine_read(engine: AsyncIOEngine, out: torch.Tensor, path: str) -> float:
    """Read ``path`` into ``out`` through ``engine`` and wait; seconds."""
    start = time.perf_counter()
    engine.read_into(out, path).wait()
    return time.perf_counter() - start


def torch_save(data: torch.Tensor, path: str) -> float:
    """``torch.save`` to ``path`` plus ``fsync`` (so both sides are durable); seconds."""
    start = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(data, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - start


def torch_load(path: str) -> float:
    """``torch.load`` of ``path`` (a fresh tensor, as torch.load always returns); seconds."""
    start = time.perf_counter()
    torch.load(path, weights_only=True)
    return time.perf_counter() - start


QUICK_GRID = {"block_size": (1 * MIB, 8 * MIB), "workers": (1, 4), "depth_per_worker": (2,)}
FULL_GRID = {"block_size": (1 * MIB, 4 * MIB, 16 * MIB), "workers": (1, 2, 4, 8), "depth_per_worker": (1, 2)}


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """One setting's medians against the raw peer measured beside it.

    Attributes:
        config: the engine setting.
        write_s, read_s: engine seconds (median).
        raw_write_s, raw_read_s: raw peer seconds (median, same rounds).
    """

    config: IOConfig
    write_s: float
    read_s: float
    raw_write_s: float
    raw_read_s: float

    @property
    def total_s(self) -> float:
        """Write plus read seconds: what the sweep minimises."""
        return self.write_s + self.read_s


def sweep(directory: str, *, nbytes: int, quick: bool, repeats: int = 3, progress=print) -> list[SweepResult]:
    """Measure every setting of the grid on ``directory``.

    Args:
        directory: where to write (the filesystem being measured).
        nbytes: bytes per write/read.
        quick: the small grid.
        repeats: rounds per setting (median taken).
        progress: called with one line per setting.

    Returns:
        One :class:`SweepResult` per setting.

    Raises:
        OffloadDiskFullError: ``directory`` lacks room for two copies of ``nbytes``.
    """
    directory = ensure_directory(directory)
    check_space(os.path.join(directory, "bench"), 2 * nbytes, min_free_bytes=64 * MIB, what="plait io bench")
    grid = QUICK_GRID if quick else FULL_GRID
    data = aligned_empty(nbytes)
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    out = aligned_empty(nbytes)
    tag = uuid.uuid4().hex[:8]
    ours_path = os.path.join(directory, f"plait-io-bench-{tag}.bin")
    raw_path = os.path.join(directory, f"plait-io-bench-raw-{tag}.bin")
    results = []
    try:
        for block, workers, depth in itertools.product(grid["block_size"], grid["workers"],
                                                       grid["depth_per_worker"]):
            config = IOConfig(block_size=min(block, nbytes), workers=workers, queue_depth=workers * depth)
            results.append(_measure(config, data, out, ours_path, raw_path, repeats))
            progress(_line(results[-1]))
    finally:
        for path in (ours_path, raw_path):
            if os.path.exists(path):
                os.unlink(path)
    return results


def _measure(config: IOConfig, data: torch.Tensor, out: torch.Tensor, ours_path: str, raw_path: str,
             repeats: int) -> SweepResult:
    times: dict[str, list[float]] = {"w": [], "r": [], "rw": [], "rr": []}
    with AsyncIOEngine(config) as engine:
        for _ in range(repeats):
            times["rw"].append(raw_write(data, raw_path))
            times["w"].append(engine_write(engine, data, ours_path))
            evict(raw_path)
            evict(ours_path)
            times["rr"].append(raw_read(out, raw_path))
            times["r"].append(engine_read(engine, out, ours_path))
    if not torch.equal(out, data):
        raise AssertionError("plait io bench: data read back differs from data written")
    med = {k: statistics.median(v) for k, v in times.items()}
    return SweepResult(config, med["w"], med["r"], med["rw"], med["rr"])


def _line(r: SweepResult) -> str:
    c = r.config
    return (f"block {c.block_size // MIB:>3} MiB  workers {c.workers}  queue_depth {c.queue_depth:>2}  "
            f"write {r.raw_write_s / r.write_s:5.2f}x raw  read {r.raw_read_s / r.read_s:5.2f}x raw")


def report(results: list[SweepResult], directory: str, nbytes: int) -> str:
    """The table, the best setting and how to use it.

    Args:
        results: from :func:`sweep`.
        directory: the measured directory.
        nbytes: bytes per operation.

    Returns:
        Printable text.
    """
    gib = nbytes / (1 << 30)
    header = (f"{'block':>9} {'workers':>7} {'q.depth':>7} {'write GiB/s':>11} {'raw':>6} {'x raw':>6} "
              f"{'read GiB/s':>10} {'raw':>6} {'x raw':>6}")
    lines = [f"plait io bench: {nbytes // MIB} MiB per operation at {directory} "
             f"(O_DIRECT {'yes' if o_direct_supported(directory, 4096) else 'no'}; writes fsync'd, reads cold)",
             header, "-" * len(header)]
    for r in results:
        c = r.config
        lines.append(f"{c.block_size // MIB:>5} MiB {c.workers:>7} {c.queue_depth:>7} {gib / r.write_s:>11.2f} "
                     f"{gib / r.raw_write_s:>6.2f} {r.raw_write_s / r.write_s:>6.2f} {gib / r.read_s:>10.2f} "
                     f"{gib / r.raw_read_s:>6.2f} {r.raw_read_s / r.read_s:>6.2f}")
    best = min(results, key=lambda r: r.total_s)
    c = best.config
    lines += [
        "",
        f"best: block_size={c.block_size} ({c.block_size // MIB} MiB), queue_depth={c.queue_depth}, "
        f"workers={c.workers}: write {best.raw_write_s / best.write_s:.2f}x and read "
        f"{best.raw_read_s / best.read_s:.2f}x the raw sequential loop.",
        "use it:",
        f"  io = IOConfig(block_size={c.block_size}, queue_depth={c.queue_depth}, workers={c.workers})",
        "  AsyncIOEngine(io)  or  OffloadedOptimizer(params, device='nvme', path=..., io=io)",
    ]
    return "\n".join(lines)
