"""Progress for long work, the way terminals expect: a live bar on a TTY, one plain line otherwise.

Every place plait shows progress goes through :func:`progress`, so the behaviour is the same
everywhere: tqdm draws the bar when the stream is a terminal; when output goes to a file or a
pipe (a log, CI), no carriage-return updates are written, only one line when the work ends.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO


@contextlib.contextmanager
def progress(desc: str, *, total: float | None = None, unit: str = "B",
             stream: TextIO | None = None) -> Iterator[Callable[[float], None]]:
    """Show progress of one piece of work.

    Args:
        desc: what is being done, e.g. ``"converting"``.
        total: the amount of work in ``unit`` when known (the bar then shows a percentage and an ETA).
        unit: ``"B"`` for bytes (shown as kB/MB/GB) or any count's name (``"step"``).
        stream: where to write (default ``sys.stderr``, read when the block starts).

    Yields:
        ``update(n)``: report ``n`` more units done.
    """
    from tqdm import tqdm

    out = stream or sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())
    done = [0.0]
    start = time.perf_counter()
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=out, leave=False,
              disable=not tty, dynamic_ncols=True) as bar:
        def update(n: float) -> None:
            done[0] += n
            bar.update(n)

        yield update
    if not tty:
        amount = f"{done[0] / 2**20:.1f} MiB" if unit == "B" else f"{done[0]:g} {unit}"
        print(f"{desc}: {amount} in {time.perf_counter() - start:.1f} s", file=out, flush=True)
