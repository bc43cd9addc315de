"""Checking a checkpoint's chunks on a second core while the consumer copies them.

vLLM's ``load_weights`` copies every tensor it is given into its parameter. Checking a tensor's
checksums before handing it over adds one pass over its bytes on the core that copies: at TP=1
about a quarter of the load (XXH3-64 reads the bytes from the page cache, taking the page faults;
the copy then finds them in cache, but the hashing is on the critical path). Here, when a core
looks free, a worker thread hashes every chunk in stream order (``xxhash`` releases the GIL while
it hashes, so it runs on the other core) while the consumer's thread hands the tensors over
without checking them and copies them. When the stream ends, the consumer's thread hashes every
chunk the worker has not started, waits up to :data:`IN_FLIGHT_WAIT_S` for the one it is hashing
(then hashes it too), and raises if any chunk is damaged: a damaged value may have been copied
into a parameter, but the load fails before it returns, so the engine never starts on it, and the
error names the file. A damaged chunk the worker has already found stops the stream at the next
tensor. Measured on the benchmark's model with a core free (load 0.9-1.0 on 2 cores): 1.11x
vLLM's safetensors stream, against 1.19x for a worker that only checked ahead of the copies
(the loading thread checking what it had not reached) and 1.32x for checking each tensor first.

Without a worker (no free core), the consumer's thread checks each tensor before handing it over.
The worker starts only when a core looks free for it (:func:`core_free`): this process may run on
two cores or more, and the one-minute load average is below their number. Otherwise it would only
contend with the consumer for a core and for the GIL between its hashes (measured slower at load
2.5-16 on 2 cores: with the kernel's autogroup scheduling, on there, the threads of a session
share one slice of CPU time, so the worker's time is taken from the consumer's), and checking
after the copies would read the bytes from memory a second time.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import torch

from plait.universal_ckpt.errors import CheckpointIntegrityError
from plait.universal_ckpt.manifest import Manifest, Piece, TensorEntry
from plait.universal_ckpt.storage import check_chunks, digest, pick_digests
from plait.vllm.checked_copy import integrity_error


@dataclasses.dataclass(frozen=True, eq=False)
class Chunk:
    """One checksum chunk of a mapped piece: its bytes and what they must hash to."""

    tensor: str  # the entry's full name, for the error
    piece: Piece
    index: int
    data: memoryview  # the piece's bytes of this chunk
    digests: tuple[str, ...]  # all of the piece's, so a failure is reported as storage reports it
    algorithm: str
    chunk_bytes: int

    def good(self) -> bool:
        """Whether the bytes hash to the manifest's digest (the GIL is released while hashing)."""
        return digest(self.algorithm, self.data) == self.digests[self.index]

    def error(self, directory: Path) -> CheckpointIntegrityError:
        """The loader's error for this chunk: names the file, the byte range and the tensor."""
        lo = self.index * self.chunk_bytes
        try:
            check_chunks(self.data, self.piece.file, self.piece.offset, self.piece.nbytes, lo, lo + len(self.data),
                         digests=self.digests, chunk_bytes=self.chunk_bytes, algorithm=self.algorithm)
        except CheckpointIntegrityError as exc:
            return integrity_error(exc, directory, self.tensor)
        return integrity_error(CheckpointIntegrityError(  # the bytes changed between two reads: still damaged
            f"checkpoint file {self.piece.file}: chunk {self.index} changed while it was read.",
            file=self.piece.file, expected=self.digests[self.index], actual="unstable"), directory, self.tensor)


def piece_chunks(tensor: torch.Tensor, entry: TensorEntry, piece: Piece, manifest: Manifest) -> list[Chunk]:
    """The checksum chunks of a whole-piece tensor, given as a contiguous view of its mapped bytes."""
    digests, algorithm = pick_digests(piece.hashes, piece.checksums, manifest.hash_algorithm)
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
    size = manifest.chunk_bytes
    return [Chunk(entry.full_name, piece, index, data[index * size:(index + 1) * size], digests, algorithm, size)
            for index in range(len(digests))]


IN_FLIGHT_WAIT_S = 0.005
"""How long the consumer waits, at the end, for the chunk the worker is hashing (a 4 MiB chunk takes
well under 1 ms) before hashing it itself: a worker descheduled mid-hash never holds the load up long."""


def core_free() -> bool:
    """Whether a worker thread would find a core idle: this thread may use two cores or more (one
    bound to a single core gets no worker) and the one-minute load average, which counts this
    process too, is below their number."""
    cores = len(os.sched_getaffinity(0))
    return cores >= 2 and os.getloadavg()[0] < cores


class AheadCheck:
    """A stream's chunk checks: on a worker thread alongside the consumer's copies, or before each tensor.

    Args:
        directory: the checkpoint directory (for error messages).
        tensors: the chunks of each tensor of the stream, in stream order (empty for a tensor
            checked another way, e.g. consolidated from several pieces as it is read).
        worker: start the worker thread, which hashes every chunk in order while the consumer
            copies (False: the consumer's thread checks each tensor before handing it over).

    Call :meth:`before` with each tensor's index before handing it over, :meth:`finish` when the
    stream has ended, and :meth:`close` in any case (it stops the worker).

    Attributes:
        checked_bytes: after :meth:`finish`, the bytes checked (every chunk's, each found good).
        worker_bytes: the bytes the worker thread hashed (the consumer's thread hashed the rest;
            a chunk both hashed, the worker's in flight when the stream ended, counts in both).
    """

    def __init__(self, directory: Path, tensors: list[list[Chunk]], *, worker: bool = True) -> None:
        self.directory = directory
        self.checked_bytes = 0
        self.worker_bytes = 0
        self._chunks = [chunk for chunks in tensors for chunk in chunks]
        self._ends = []  # tensor i's chunks are self._chunks[self._ends[i - 1]:self._ends[i]]
        for chunks in tensors:
            self._ends.append((self._ends[-1] if self._ends else 0) + len(chunks))
        self._good = [False] * len(self._chunks)
        self._bad: Chunk | None = None
        self._cond = threading.Condition()
        self._next = 0  # the first chunk neither thread has claimed
        self._closed = False
        self._worker = None
        if worker:
            self._worker = threading.Thread(target=self._work, name="plait-vllm-check", daemon=True)
            self._worker.start()

    @property
    def worker(self) -> bool:
        """Whether a worker thread checks alongside the copies (else the consumer's thread checks everything)."""
        return self._worker is not None

    def _claim(self, bound: int) -> int | None:
        """The next unclaimed chunk below ``bound`` (now this thread's), or None."""
        with self._cond:
            if self._closed or self._next >= bound:
                return None
            self._next += 1
            return self._next - 1

    def _run(self, index: int) -> None:
        chunk = self._chunks[index]
        if chunk.good():
            self._good[index] = True
        elif self._bad is None:
            self._bad = chunk

    def _work(self) -> None:
        # Nothing depends on this thread finishing: should it die, finish() hashes what it left.
        while (index := self._claim(len(self._chunks))) is not None:
            self._run(index)
            self.worker_bytes += len(self._chunks[index].data)
            with self._cond:
                self._cond.notify_all()  # finish() may be waiting for this chunk

    def _raise_if_bad(self) -> None:
        if self._bad is not None:
            raise self._bad.error(self.directory)

    def before(self, index: int) -> None:
        """Before tensor ``index`` is handed over: without a worker, check its chunks.

        Raises:
            CheckpointIntegrityError: a chunk checked so far is damaged (names the file).
        """
        if self._worker is None:
            while (claimed := self._claim(self._ends[index])) is not None:
                self._run(claimed)
                self._raise_if_bad()
        self._raise_if_bad()

    def _settled(self) -> bool:
        return self._bad is not None or all(self._good)

    def finish(self) -> None:
        """Check every chunk the worker has not started; wait up to :data:`IN_FLIGHT_WAIT_S` for the one
        it is hashing, then hash any chunk still not found good here.

        Raises:
            CheckpointIntegrityError: a chunk is damaged (names the file and the tensor).
        """
        while (claimed := self._claim(len(self._chunks))) is not None:
            self._run(claimed)
        deadline = time.monotonic() + IN_FLIGHT_WAIT_S
        with self._cond:
            while not self._settled() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
        for index, good in enumerate(self._good):
            if not good and self._bad is None:
                self._run(index)
        self._raise_if_bad()
        self.checked_bytes = sum(len(chunk.data) for chunk in self._chunks)

    def close(self) -> None:
        """Stop the worker (after the chunk it is hashing) and wait for it."""
        with self._cond:
            self._closed = True
        if self._worker is not None:
            self._worker.join()
