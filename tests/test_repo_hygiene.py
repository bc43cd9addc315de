"""No tracked file names a path of the machine it was made on, or a document outside the repository.

A results file, README or docstring that says ``/home/someone/...`` or "see design.md" points a
reader at something they do not have. Commands in results files are written repo-relative
(``packages/<dir>/benchmarks/results/...``); rules a comment cites live in ``docs/``; a tracker's
issue numbers mean nothing to a reader of the repository. Reads the files ``git ls-files`` lists
(about 7 MB), so it takes well under a second.
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
