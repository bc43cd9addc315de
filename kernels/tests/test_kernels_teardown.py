"""A finished process exits 0 even when its flight-log publisher is inside a store call at exit.

``teardown_publisher_job.py`` holds the publisher in a real torch store call (a 2 s ``get``)
when the main thread finishes, and makes interpreter teardown take 4 s. Before the fix, exit
waited at most 1 s for the publisher, teardown began, the store call returned inside it and the
process aborted with SIGABRT, "terminate called without an active exception": one way to the
abort a CI run saw after a finished two-node ZeRO++ job (not the only one: docs/reliability.md,
"A finished run exits 0"). Now exit waits until the publisher has left the call (its reports
have their own short timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("teardown_publisher_job.py")


@pytest.mark.skipif(sys.platform != "linux", reason="the abort is Linux's pthread_exit through C++ frames")
def test_exit_waits_for_the_publisher_to_leave_its_store_call():
    done = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split("\n")[0] == "main thread done"
