"""pytest plugin for CI: a test that already passed where its distribution was installed alone is
not run a second time in the full environment.

``ci/check_install_alone.py`` runs every distribution's own tests in a venv holding only that
distribution; ``ci/test.sh`` then runs the whole suite in the full environment. Running a package
test twice doubles CI's longest stage and proves little more: the second run differs only in the
optional extras present. So the install-alone run records what passed
(``PLAIT_RECORD_PASSED=<file>``) and the full run deselects exactly those
(``PLAIT_SKIP_PASSED=<folder of such files>``). What skipped alone (an extra such as transformers
was absent), failed, or was never collected there still runs in the full environment, as do the
top-level cross-package tests. Without either variable the plugin does nothing.

Load it with ``-p passed_alone`` and ``ci/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

RECORD = "PLAIT_RECORD_PASSED"
SKIP = "PLAIT_SKIP_PASSED"


def passed_before(folder: Path) -> set[str]:
    """Every node id recorded in ``folder``'s ``*.txt`` files."""
    ids: set[str] = set()
    for path in sorted(folder.glob("*.txt")):
        ids.update(line for line in path.read_text().splitlines() if line)
    return ids


class _Recorder:
    """Appends the node id of each test whose setup, call and teardown all passed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bad: set[str] = set()
        self.called: set[str] = set()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed or (report.skipped and report.when != "teardown"):
            self.bad.add(report.nodeid)
        elif report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
            self.called.add(report.nodeid)
        if report.when == "teardown" and report.nodeid in self.called and report.nodeid not in self.bad:
            with self.path.open("a") as out:
                out.write(report.nodeid + "\n")


class _Skipper:
    """Deselects the tests a recorder saw pass."""

    def __init__(self, ids: set[str]) -> None:
        self.ids = ids

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        done = [item for item in items if item.nodeid in self.ids]
        if done:
            config.hook.pytest_deselected(items=done)
            items[:] = [item for item in items if item.nodeid not in self.ids]

    def pytest_report_header(self) -> str:
        return f"passed_alone: {len(self.ids)} tests that passed with their distribution installed alone are not rerun"


def pytest_configure(config: pytest.Config) -> None:
    """Register the recorder and/or the skipper the environment asks for."""
    if os.environ.get(RECORD):
        config.pluginmanager.register(_Recorder(Path(os.environ[RECORD])), "passed_alone_recorder")
    if os.environ.get(SKIP):
        folder = Path(os.environ[SKIP])
        if not folder.is_dir():
            raise pytest.UsageError(f"{SKIP}={folder}: no such folder (unset it to run every test)")
        config.pluginmanager.register(_Skipper(passed_before(folder)), "passed_alone_skipper")
