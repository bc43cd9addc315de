"""Fault injection for failure tests: hang, kill, SIGTERM, raise, slow down, fill the disk of one
rank at one step, or damage the newest checkpoint and kill the rank.

The failure tests (docs/reliability.md, R8 and R9) all need the same thing: at step ``k`` on rank
``r``, something goes wrong, and every other rank must end with a clear error. One small helper,
called once per step from a test's training loop, keeps those tests short and alike::

    fault = Fault("hang", rank=1, step=5)
    for step in range(10):
        fault.maybe_inject(step)
        ...

A fault can also travel as text (a script's argument, an environment variable of a launched job):
``Fault.parse("hang:rank=1:step=5:seconds=60")``.

A full disk is stood in for by a file-size limit (``RLIMIT_FSIZE``, no privileges or loop devices
needed): from the fault's step on, this process cannot write any file past ``nbytes`` bytes, and
such a write fails with ``OSError(EFBIG)`` (SIGXFSZ is ignored, so it is an error, not a kill),
as a write to a full disk fails with ``ENOSPC``. :func:`lift_disk_full` gives the space back.

A damaged checkpoint (``damaged``) is a bit flipped in the middle of the largest file of the newest
checkpoint directory (bit rot, a torn copy), after which the rank is killed: the restart must notice
the damage (the checkpoint's hashes no longer match) and resume from an older checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

KINDS = ("hang", "kill", "sigterm", "raise", "slow", "diskfull", "damaged")


class InjectedFaultError(RuntimeError):
    """The error a ``raise`` fault raises (so a test can tell it from a real failure)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault at one rank and step.

    Attributes:
        kind: ``hang`` (sleep ``seconds``, never entering the next collective), ``kill`` (SIGKILL
            itself: a dead rank), ``sigterm`` (SIGTERM itself, as a scheduler's preemption does),
            ``raise`` (raise :class:`InjectedFaultError`), ``slow`` (sleep ``seconds`` at this step and
            every later one: a straggler), ``diskfull`` (from this step on, no file of this process
            can grow past ``nbytes``: writes fail with ``OSError(EFBIG)``; Linux and macOS),
            ``damaged`` (flip a bit of the newest checkpoint given to :meth:`maybe_inject`, then
            SIGKILL itself, as ``kill``).
        rank: the global rank that misbehaves.
        step: the first step at which it does.
        seconds: how long a ``hang`` lasts or how much a ``slow`` rank is late each step.
        nbytes: the largest file a ``diskfull`` rank can still write.
    """

    kind: str
    rank: int
    step: int
    seconds: float = 3600.0
    nbytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault.kind={self.kind!r} is unknown; use one of {', '.join(KINDS)}.")
        if self.rank < 0 or self.step < 0:
            raise ValueError(f"Fault rank={self.rank} and step={self.step} must be >= 0.")
        if self.seconds < 0:
            raise ValueError(f"Fault.seconds={self.seconds} must be >= 0.")
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"Fault.nbytes={self.nbytes!r} must be an int >= 0.")
        if self.kind == "diskfull" and sys.platform == "win32":
            raise ValueError("Fault(kind='diskfull') needs RLIMIT_FSIZE (Linux or macOS).")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """A fault from ``kind:rank=R:step=S[:seconds=T][:nbytes=N]`` (as :meth:`__str__` writes it).

        Raises:
            ValueError: the text is not in that form; the message shows the form.
        """
        kind, *fields = text.strip().split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            return cls(kind=kind, rank=int(values.pop("rank")), step=int(values.pop("step")),
                       **{key: int(value) if key == "nbytes" else float(value) for key, value in values.items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"fault {text!r} is not of the form kind:rank=R:step=S[:seconds=T] "
                             f"(e.g. hang:rank=1:step=5:seconds=60): {exc}") from exc

    def __str__(self) -> str:
        text = f"{self.kind}:rank={self.rank}:step={self.step}:seconds={self.seconds:g}"
        return f"{text}:nbytes={self.nbytes}" if self.nbytes else text

    def fires(self, step: int, rank: int) -> bool:
        """Whether this fault acts on ``rank`` at ``step``."""
        if rank != self.rank:
            return False
        return step >= self.step if self.kind == "slow" else step == self.step

    def maybe_inject(self, step: int, rank: int | None = None, *, checkpoint: Path | None = None) -> None:
        """Call once per step on every rank; acts when this is the fault's rank and step.

        Args:
            step: the current step.
            rank: this process's rank (default: ``torch.distributed``'s, or ``RANK``).
            checkpoint: for ``damaged``, the newest checkpoint directory (None: there is none yet,
                and the fault is a plain ``kill``).

        Raises:
            InjectedFaultError: for a ``raise`` fault.
        """
        if not self.fires(step, _rank() if rank is None else rank):
            return
        if self.kind == "damaged" and checkpoint is not None:
            damage_file(largest_file(checkpoint))
        if self.kind in ("hang", "slow"):
            _sleep(self.seconds)
        elif self.kind in ("kill", "damaged"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "diskfull":
            fill_disk(self.nbytes)
        else:
            raise InjectedFaultError(f"injected fault on rank {self.rank} at step {step}")


def fill_disk(nbytes: int) -> None:
    """Make every later write of this process past ``nbytes`` bytes of a file fail with EFBIG."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then returns EFBIG instead of killing us
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))


def largest_file(directory: Path) -> Path:
    """The largest regular file under ``directory`` (a checkpoint's: one of its tensor data files).

    Raises:
        FileNotFoundError: ``directory`` holds no file.
    """
    files = [path for path in Path(directory).rglob("*") if path.is_file() and not path.is_symlink()]
    if not files:
        raise FileNotFoundError(f"{directory} holds no file to damage; give a checkpoint directory.")
    return max(files, key=lambda path: (path.stat().st_size, str(path)))


def damage_file(path: Path) -> int:
    """Flip the lowest bit of the byte in the middle of ``path`` in place; returns its offset.

    Raises:
        ValueError: the file is empty (nothing to damage).
    """
    size = Path(path).stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty; damage a file that holds data.")
    offset = size // 2
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 1]))
        handle.flush()
        os.fsync(handle.fileno())
    return offset


def lift_disk_full() -> None:
    """Undo a ``diskfull`` fault in this process (the soft file-size limit back to the hard one)."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _sleep(seconds: float) -> None:
    """Sleep in short slices, so signal handlers (SIGTERM, SIGUSR1 stack dumps) run promptly."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))
