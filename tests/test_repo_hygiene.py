"""No tracked file names a path of the machine it was made on, or a document outside the repository.

A results file, README or docstring that says ``/home/someone/...`` or "see design.md" points a
reader at something they do not have. Commands in results files are written repo-relative
(``packages/<dir>/benchmarks/results/...``); rules a comment cites live in ``docs/``; a tracker's
issue numbers mean nothing to a reader of the repository. And the READMEs and docs pages say what
holds, not how a run went (its date, clock time, how busy the machine was) outside the generated
line under each results table. Reads the files ``git ls-files`` lists (about 7 MB) once: a few
seconds.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Absolute home or work directories of some machine (``/tmp/...`` in tests and examples is a
# user's scratch path, not a machine's, and is allowed).
MACHINE_PATH = re.compile(r"(?<![\w.:/-])/(?:work|home|Users|root|scratch|mnt/[a-z])/[\w.-]")
# Documents that live beside the repository, not in it.
OUTSIDE_DOCUMENT = re.compile(r"\b(?:design|engine-notes|user-stories)\.md\b|\.\./shared\b")
# A tracker's numbered issues: the repository says what holds, not which ticket asked for it. An
# upstream project's issue is cited by name ("Lightning's GitHub issues #8130", "pytorch/pytorch#1").
TRACKER_ISSUE = re.compile(r"(?<!GitHub )\bissues? (?:#?\d+)\b", re.IGNORECASE)

CHECKS = {"a machine path": MACHINE_PATH, "a document outside the repository": OUTSIDE_DOCUMENT,
          "a tracker's issue number": TRACKER_ISSUE}

# How one run went, in the prose of a README or a docs page: its date, clock time, the machine's
# state. Table rows and the generated line under a results table (it starts with the run's ISO
# date) carry the date, machine and load on purpose and are left alone.
RUN_LOG = re.compile(r"quiet machine|this session|nearly idle|nothing else running|\b\d{1,2}:\d{2} UTC\b"
                     r"|(?<![\w-])20\d\d-\d\d-\d\d(?![T\d])", re.IGNORECASE)
GENERATED_LINE = re.compile(r"^(\||20\d\d-\d\d-\d\dT)")


@functools.cache
def tracked_texts() -> dict[Path, str]:
    """Every file git tracks that decodes as UTF-8, by path (binary files such as PNGs are left out)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                                timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an installed copy), nothing to scan")
    texts = {}
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path == Path(__file__).resolve():
            continue
        try:
            texts[path] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def findings(text: str, pattern: re.Pattern[str]) -> list[str]:
    """``line N: <line>`` for each line of ``text`` the pattern matches."""
    if not pattern.search(text):  # most files: one scan, no line split
        return []
    return [f"line {number}: {line.strip()[:160]}" for number, line in enumerate(text.splitlines(), 1)
            if pattern.search(line)]


@pytest.mark.parametrize("what", sorted(CHECKS))
def test_no_tracked_file_names(what):
    found = [f"{path.relative_to(ROOT)} {hit}" for path, text in tracked_texts().items()
             for hit in findings(text, CHECKS[what])]
    assert not found, (f"{len(found)} lines name {what}; write repo-relative paths, cite docs/ in this "
                       "repository, and say what holds rather than which issue asked:\n" + "\n".join(found[:40]))


@pytest.mark.parametrize(("line", "what"), [
    ("wrote /work/main/packages/x/results.json", "a machine path"),
    ("PNG: /home/alice/plait/plot.png", "a machine path"),
    ("see design.md for the rule", "a document outside the repository"),
    ("in ../shared/benchmarks.md", "a document outside the repository"),
    ("the README table (issue 18)", "a tracker's issue number"),
])
def test_the_patterns_catch_what_they_are_for(line, what):
    assert findings(line, CHECKS[what])


@pytest.mark.parametrize("line", [
    "plait train --out /tmp/mj", "packages/ulysses-sp/benchmarks/results/ulysses-sp.json",
    "docs/architecture.md", "https://github.com/pytorch/pytorch/issues/190489", "as root for the namespaces",
    "(Lightning's GitHub issues #8130 and #9303)",
    "file:///tmp/site/index.html",
])
def test_the_patterns_leave_ordinary_lines_alone(line):
    assert not any(findings(line, pattern) for pattern in CHECKS.values()), line


def user_pages() -> list[Path]:
    """The READMEs of the distributions and the hand-written pages directly under docs/."""
    return [ROOT / "kernels" / "README.md", *sorted(ROOT.glob("packages/*/README.md")),
            *sorted(ROOT.glob("integrations/*/README.md")), *sorted((ROOT / "docs").glob("*.md"))]


def run_log_lines(text: str) -> list[str]:
    """``line N: <line>`` for each prose line (not a table row or a generated line) naming a run's
    date, clock time or the machine's state."""
    return [f"line {number}: {line.strip()[:160]}" for number, line in enumerate(text.splitlines(), 1)
            if not GENERATED_LINE.match(line) and RUN_LOG.search(line)]


def test_readmes_and_docs_carry_no_run_log_prose():
    found = [f"{page.relative_to(ROOT)} {hit}" for page in user_pages() if page.is_file()
             for hit in run_log_lines(page.read_text(encoding="utf-8"))]
    assert not found, ("pages speak to users, not about how a run went; the date, machine and load of a "
                       "measurement belong in the generated line under its table:\n" + "\n".join(found[:40]))


def test_run_log_lines_leave_tables_and_generated_lines_alone():
    text = "\n".join(["Measured 2026-11-25 on a quiet machine.", "at 19:56 UTC", "| a | 2026-11-25 |",
                     "2026-11-25T20:02:51+00:00, Linux, 2 CPUs, `plait bench x` (x.json)",
                     "kept in `results/x-2026-11-21T2122.txt`"])
    assert [hit.split(":")[0] for hit in run_log_lines(text)] == ["line 1", "line 2"]
