"""The selftest's building blocks: a check, its outcome, the run loop with time caps, the table.

A check is a function of a :class:`SelftestContext` that returns an :class:`Outcome` (or raises
:class:`Skip` with the reason). The same function runs on a GPU with real model shapes and on the
CPU dry run with tiny ones (``ctx.pick(real, tiny)``), so the CPU run in CI exercises the code the
GPU run will execute.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
MIN_LEFT_S = 5.0  # below this much of the run's budget, a check is not started (a SKIP row instead)


class Skip(Exception):  # noqa: N818 - raised to mean "skip", like unittest.SkipTest
    """Raised by a check that cannot run here; the message is the reason shown in the table."""


class CapReached(Exception):  # noqa: N818 - a signal, not an error
    """Raised by :meth:`Deadline.check` when a check has used its time cap."""


class Deadline:
    """The time cap of the check now running; checks call :meth:`check` between their cases."""

    def __init__(self) -> None:
        self._end = float("inf")

    def start(self, cap_s: float) -> None:
        """Start a cap of ``cap_s`` seconds from now."""
        self._end = time.monotonic() + cap_s

    def check(self, what: str = "") -> None:
        """Raise :class:`CapReached` when the cap is used up.

        Args:
            what: the case about to start, for the message.

        Raises:
            CapReached: the check ran past its cap.
        """
        if time.monotonic() > self._end:
            raise CapReached(f"time cap reached before {what or 'the next case'}")


@dataclasses.dataclass(frozen=True)
class SelftestContext:
    """Where and how the checks run.

    Attributes:
        device: the device under test (``cuda`` on a GPU, ``cpu`` on a dry run).
        dry_run: True without a GPU: tiny shapes, Triton interpreter, gloo; no figure is a GPU figure.
        deadline: the running check's time cap.
    """

    device: torch.device
    dry_run: bool
    deadline: Deadline = dataclasses.field(default_factory=Deadline)

    def pick(self, real, tiny):
        """``real`` on a GPU, ``tiny`` on a dry run (shapes, repeats, model sizes)."""
        return tiny if self.dry_run else real

    def sync(self) -> None:
        """Wait for the device (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one check found.

    Attributes:
        status: ``PASS``, ``FAIL`` or ``SKIP``.
        figure: what the value measures, e.g. ``"max |err| / bound"`` or ``"share of copy BW"``.
        value: the measured number (None when there is none, e.g. a skip).
        target: the bar, as text (``"<= 1"``, ``">= 0.90"``); empty when the row has none.
        note: the details a reader needs (shapes, the worst case, why it was skipped).
    """

    status: str
    figure: str = ""
    value: float | None = None
    target: str = ""
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the selftest table.

    Attributes:
        name: ``<distribution>/<what>``, e.g. ``"kernels/rms_norm"``; what ``--only``/``--skip`` match.
        run: ``run(ctx) -> Outcome``; may raise :class:`Skip`, and should call
            ``ctx.deadline.check()`` between its cases.
        cap_s: the time cap on a GPU (the dry run uses the same cap).
    """

    name: str
    run: Callable[[SelftestContext], Outcome]
    cap_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class Row:
    """A check's outcome with its name and wall time."""

    name: str
    outcome: Outcome
    seconds: float


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether a check's name matches one of ``patterns`` (a shell pattern, or a substring of it)."""
    return any(fnmatch.fnmatch(name, p) or p in name for p in patterns)


def selected(checks: Sequence[Check], only: Sequence[str], skip: Sequence[str]) -> list[Check]:
    """The checks ``--only``/``--skip`` keep.

    Args:
        checks: every discovered check.
        only: shell patterns or substrings; a check is kept if it matches one (all kept if empty).
        skip: shell patterns or substrings; a matching check is dropped.

    Returns:
        The kept checks, in order.
    """
    return [c for c in checks if (not only or matches(c.name, only)) and not matches(c.name, skip)]


def run_one(check: Check, ctx: SelftestContext, *, cap_s: float | None = None) -> Row:
    """Run one check under its cap: cooperative (``ctx.deadline``) and, as a backstop, a thread
    that is abandoned (row FAIL) if it has not returned 30 s after the cap.

    Args:
        check: the check.
        ctx: the context.
        cap_s: the cap to use instead of ``check.cap_s`` (what is left of the run's budget).

    Returns:
        The row; an exception other than :class:`Skip` makes it FAIL with the exception's text.
    """
    cap = check.cap_s if cap_s is None else cap_s
    box: dict[str, Outcome] = {}

    def target() -> None:
        try:
            box["out"] = check.run(ctx)
        except Skip as exc:
            box["out"] = Outcome(SKIP, note=str(exc))
        except CapReached as exc:
            box["out"] = Outcome(FAIL, note=f"{exc} (cap {cap:.0f} s)")
        except Exception as exc:  # noqa: BLE001 - a failing check is a FAIL row, not a crash
            first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
            box["out"] = Outcome(FAIL, note=f"{type(exc).__name__}: {first_line}")

    start = time.monotonic()
    ctx.deadline.start(cap)
    worker = threading.Thread(target=target, name=f"selftest {check.name}", daemon=True)
    worker.start()
    worker.join(cap + 30.0)
    outcome = box.get("out") or Outcome(FAIL, note=f"did not return within its cap of {cap:.0f} s + 30 s")
    return Row(check.name, outcome, time.monotonic() - start)


def run_all(checks: Sequence[Check], ctx: SelftestContext, *, budget_s: float = float("inf"), out=None) -> list[Row]:
    """Run ``checks`` in order, printing (and flushing) one progress line as each finishes.

    Args:
        checks: the checks to run.
        ctx: the context.
        budget_s: seconds for the whole run: each check's cap is cut to what is left, and once
            less than :data:`MIN_LEFT_S` is left the remaining checks are SKIP rows that say so
            (rerun them with ``--only``).
        out: the stream for progress lines (default ``sys.stdout``).

    Returns:
        One row per check.
    """
    out = out or sys.stdout
    rows = []
    end = time.monotonic() + budget_s
    for index, check in enumerate(checks, 1):
        left = end - time.monotonic()
        if left < MIN_LEFT_S:
            row = Row(check.name, Outcome(SKIP, note=f"the run's budget of {budget_s:.0f} s is spent; "
                                                       f"rerun with --only '{check.name}'"), 0.0)
        else:
            row = run_one(check, ctx, cap_s=min(check.cap_s, left))
        rows.append(row)
        print(f"[{index}/{len(checks)}] {row.outcome.status} {check.name} ({row.seconds:.1f} s)", file=out, flush=True)
    return rows


def _value(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.4g}"


def format_table(rows: Sequence[Row]) -> str:
    """The one table: a row per check with status, figure, value, target, seconds and note."""
    head = ("check", "status", "figure", "value", "target", "s", "note")
    cells = [head] + [(r.name, r.outcome.status, r.outcome.figure, _value(r.outcome.value), r.outcome.target,
                       f"{r.seconds:.1f}", r.outcome.note) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head) - 1)) + "  " + c[-1] for c in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
