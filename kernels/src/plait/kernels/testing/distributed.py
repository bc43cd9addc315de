"""Run a function on N gloo ranks, carrying results, failures and skips back to the caller.

Why it is built this way:

* Ranks are started from a forkserver that has already imported torch (and transformers and
  Lightning where they are installed: ``preload.py``), so those imports are paid once per test
  session, not once per rank of every test, and no rank inherits OpenMP threads from a parent.
* The function is found in the child by module name, or by file path when the module is not
  importable by name (pytest's ``importlib`` mode), so test functions need no special packaging.
* Results and errors travel through files written with ``torch.save`` rather than a queue, so a
  rank that exits right after returning never loses its result to a feeder thread.
* On a timeout every unfinished rank is asked for its Python stack (``faulthandler`` on
  SIGUSR1) and then killed; the error names each stuck rank and the line it was stuck on. After
  the first rank fails the others get a short grace period and are killed too, so one failure
  never becomes a hang in a collective.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.kernels import settings

GRACE_AFTER_FAILURE_S = 10.0


class DistributedTestError(RuntimeError):
    """A rank raised; the message carries the failing rank's traceback."""


class DistributedTimeoutError(DistributedTestError):
    """Ranks were still running at the deadline; the message names them and where they were."""


@dataclasses.dataclass(frozen=True)
class _FunctionRef:
    module: str
    path: str | None
    qualname: str

    @classmethod
    def of(cls, fn: Callable) -> _FunctionRef:
        if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
            raise ValueError(
                f"run_distributed needs a module-level function, got {fn.__qualname__!r}; "
                "move it to the top level of its module so child processes can import it."
            )
        module = sys.modules.get(fn.__module__)
        return cls(fn.__module__, getattr(module, "__file__", None), fn.__qualname__)

    def resolve(self) -> Callable:
        module = sys.modules.get(self.module)
        if module is None:
            try:
                module = importlib.import_module(self.module)
            except ImportError:
                if self.path is None:
                    raise
                spec = importlib.util.spec_from_file_location(self.module, self.path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[self.module] = module
                spec.loader.exec_module(module)
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Imported once by the forkserver, before it forks any rank: torch, and (plait.kernels.testing.preload)
# the optional heavy imports most tests' ranks make (transformers, Lightning), each skipped if it
# does not import cleanly, so a missing or broken one never takes the server down.
_PRELOAD = ["torch", "torch.distributed", "plait.kernels.testing.preload"]


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _leave_together(rank: int, world_size: int, timeout: float, expect_dead: tuple[int, ...]) -> None:
    """Rank 0 hosts the store that every rank's group creation talks through, and destroying its
    process group takes the store away: so it waits (bounded by the test's timeout) until each
    other rank has said it is done with the store. Without this, a rank whose own work needed no
    collective with the others (a mesh dimension of size 1, a subgroup it is not in) could finish
    first and leave a slower rank's next store request to fail with "Connection reset by peer"."""
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        store.set(f"plait-test-done/{rank}", b"1")
        others = [f"plait-test-done/{r}" for r in range(1, world_size) if r not in expect_dead]
        if rank == 0 and others:
            store.wait(others, datetime.timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - a group the test tore down (or a broken one) has nothing to wait for
        pass


def _rank_main(ref: _FunctionRef, rank: int, world_size: int, port: int, backend: str, threads: int,
               timeout: float, environ: dict[str, str], workdir: str, args: tuple, kwargs: dict,
               expect_dead: tuple[int, ...] = ()) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    stack_file = open(Path(workdir, f"stack{rank}.txt"), "w")  # noqa: SIM115 - must outlive this frame
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    outcome: tuple[str, Any, float]
    try:
        if world_size > 0:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        outcome = ("ok", ref.resolve()(*args, **kwargs), time.time())
    except BaseException as exc:  # noqa: BLE001 - everything, skips included, goes back to the parent
        kind = "skip" if type(exc).__name__ == "Skipped" else "error"
        # The time lets the parent report the rank that failed first, not the ranks whose
        # collectives broke because of it.
        outcome = (kind, "".join(traceback.format_exception(exc)), time.time())
    finally:
        if dist.is_initialized():
            if outcome[0] != "error" or rank != 0:  # a failed rank 0 leaves at once (the others see it fail)
                _leave_together(rank, world_size, timeout, expect_dead)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group must not hide the real outcome
                pass
    buffer = io.BytesIO()
    try:
        torch.save(outcome, buffer)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result becomes a readable error
        buffer = io.BytesIO()
        torch.save(("error", f"rank {rank} returned an unsaveable result: {exc!r}", time.time()), buffer)
    tmp = Path(workdir, f"result{rank}.tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(Path(workdir, f"result{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip atexit handlers that could hang on half-torn-down gloo state


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 90.0, backend: str = "gloo",
                    threads: int = 1, env: dict[str, str] | None = None, expect_dead: tuple[int, ...] = (),
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` freshly spawned ranks and return their results.

    Each rank has ``RANK``/``WORLD_SIZE`` set and the default process group initialised with
    ``backend``; ``fn`` must be a module-level function and its results picklable by torch.save.

    Args:
        fn: the function every rank runs.
        world_size: number of ranks (1-4 on the project's CPU machines).
        *args, **kwargs: passed to ``fn`` on every rank.
        timeout: seconds before every rank is killed (scaled by ``PLAIT_TEST_TIMEOUT_SCALE``);
            also the process group's own timeout.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        threads: torch threads per rank (the project measures with one).
        env: extra environment variables for the ranks (the caller's environment is inherited).
        expect_dead: ranks a test kills on purpose (a dead rank, R9): such a rank dying without
            a result is not a failure, its result is ``None``, and the others' results come back.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        DistributedTimeoutError: ranks still running at the deadline, named with their stacks.
        DistributedTestError: a rank raised or died; the first failure's traceback is included.
        pytest.skip.Exception: a rank called ``pytest.skip`` (re-raised in the caller).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    if any(not 0 <= rank < world_size for rank in expect_dead):
        raise ValueError(f"expect_dead={expect_dead!r} must hold ranks of 0..{world_size - 1}.")
    timeout *= settings.test_timeout_scale()
    ref = _FunctionRef.of(fn)
    environ = {**os.environ, **(env or {})}
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="plait-dist-") as workdir:
        port = free_port()
        procs = [
            ctx.Process(target=_rank_main, name=f"plait-rank{rank}", daemon=True,
                        args=(ref, rank, world_size, port, backend, threads, timeout, environ, workdir,
                              args, kwargs, expect_dead))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            outcomes = _wait_for_ranks(procs, Path(workdir), time.monotonic() + timeout, timeout, expect_dead)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
    return _results_or_raise(outcomes, fn.__qualname__)


def _read_outcome(workdir: Path, rank: int) -> tuple[str, Any, float] | None:
    path = workdir / f"result{rank}.pt"
    if not path.exists():
        return None
    import torch

    return torch.load(path, weights_only=False)


def _wait_for_ranks(procs: list, workdir: Path, deadline: float, timeout: float,
                    expect_dead: tuple[int, ...] = ()) -> list[tuple[str, Any, float]]:
    outcomes: dict[int, tuple[str, Any, float]] = {}
    failed_at: float | None = None
    while len(outcomes) < len(procs):
        for rank, proc in enumerate(procs):
            if rank in outcomes or proc.is_alive():
                continue
            proc.join()
            outcome = _read_outcome(workdir, rank)
            if outcome is None and rank in expect_dead:
                outcome = ("ok", None, time.time())  # killed on purpose by the test
            outcomes[rank] = outcome or ("error", f"rank {rank} died with exit code {proc.exitcode} "
                                                  "before returning (killed, crashed or os._exit).", time.time())
            if outcomes[rank][0] == "error" and failed_at is None:
                failed_at = time.monotonic()
        now = time.monotonic()
        grace_over = failed_at is not None and now - failed_at > GRACE_AFTER_FAILURE_S
        if len(outcomes) < len(procs) and (now > deadline or grace_over):
            stuck = [rank for rank in range(len(procs)) if rank not in outcomes]
            stacks = _collect_stacks(procs, stuck, workdir)
            if grace_over:
                for rank in stuck:
                    outcomes[rank] = ("error", f"rank {rank} was still running {GRACE_AFTER_FAILURE_S:.0f}s "
                                               f"after another rank failed; killed.\n{stacks[rank]}", time.time())
                break
            raise DistributedTimeoutError(
                f"timeout after {timeout:.0f}s: rank(s) {stuck} still running (of {len(procs)}); "
                + "".join(f"\n--- rank {rank} was at: {_innermost(stacks[rank])}\n{stacks[rank]}" for rank in stuck)
            )
        time.sleep(0.02)
    return [outcomes[rank] for rank in range(len(procs))]


def _collect_stacks(procs: list, ranks: list[int], workdir: Path) -> dict[int, str]:
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.5)
    stacks = {}
    for rank in ranks:
        procs[rank].kill()
        text = (workdir / f"stack{rank}.txt").read_text() if (workdir / f"stack{rank}.txt").exists() else ""
        stacks[rank] = text.strip() or "(no stack: the rank did not answer SIGUSR1)"
    return stacks


def _innermost(stack: str) -> str:
    """The first frame line of the main thread's dump (faulthandler prints innermost first)."""
    for block in stack.split("\n\n"):
        if "Current thread" in block or "Thread" in block:
            for line in block.splitlines()[1:]:
                if line.strip().startswith("File"):
                    return line.strip()
    return "unknown"


def _results_or_raise(outcomes: list[tuple[str, Any, float]], name: str) -> list[Any]:
    errors = sorted((when, rank, payload) for rank, (kind, payload, when) in enumerate(outcomes) if kind == "error")
    if errors:
        _, rank, payload = errors[0]
        others = [other for _, other, _ in errors[1:]]
        also = f" (rank(s) {others} failed after it, likely as a consequence)" if others else ""
        raise DistributedTestError(f"{name} failed on rank {rank} of {len(outcomes)}{also}:\n{payload}")
    skips = [payload for kind, payload, _ in outcomes if kind == "skip"]
    if skips:
        import pytest

        pytest.skip(skips[0].strip().splitlines()[-1])
    return [payload for _, payload, _ in outcomes]
