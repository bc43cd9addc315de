"""Finding processes a test left behind, by a token in their command line (Linux, ``/proc``).

Failure tests launch jobs (torchrun, Lightning's launcher, SLURM-style restarts) and must show that
no process of the job is left once it ends. Each job runs with a unique directory on its command
line, so a scan of ``/proc`` for that directory finds exactly its processes. Read from ``/proc``
rather than psutil, which the distributions do not install.
"""

from __future__ import annotations

import os
from pathlib import Path


def live_processes_mentioning(token: str) -> list[str]:
    """Every live process (not a zombie: dead, only not yet reaped) whose command line holds ``token``.

    Args:
        token: text to look for, typically the job's unique output directory.

    Returns:
        ``"pid: command line"`` per process found; the calling process is never listed.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it ended while we looked
            continue
        if token in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found
