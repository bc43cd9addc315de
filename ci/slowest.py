"""Print the slowest tests of a whole ``ci/test.sh`` run, read from the JUnit XML files that every
pytest run of it writes (``build/junit/<run>.xml``): the install-alone runs, the main lane and the
second lane together, so the list at the end of CI's output says where the time goes wherever a
test ran.

Usage: ``python ci/slowest.py [FOLDER] [COUNT]`` (defaults ``build/junit`` and 30).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def slowest(folder: Path, count: int) -> list[tuple[float, str, str]]:
    """The ``count`` slowest test cases as ``(seconds, run, test id)``, slowest first."""
    rows = []
    for path in sorted(folder.glob("*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            rows.append((float(case.get("time") or 0.0), path.stem, name))
    return sorted(rows, reverse=True)[:count]


def main() -> int:
    """Print the table; a missing folder prints a line saying so (never fails the run)."""
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "build/junit")
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    if not folder.is_dir():
        print(f"slowest tests: no JUnit files under {folder}")
        return 0
    rows = slowest(folder, count)
    total = sum(float(case.get("time") or 0.0) for path in folder.glob("*.xml")
                for case in ET.parse(path).getroot().iter("testcase"))
    print(f"slowest {len(rows)} tests of this run (all runs together: {total:.0f} s of test time)")
    print(f"{'seconds':>8}  {'run':<28} test")
    for seconds, run, name in rows:
        print(f"{seconds:8.1f}  {run:<28} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
