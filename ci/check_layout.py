"""Layout check: every distribution has the parts design.md names, and names map as it says.

For each of kernels/, packages/*, integrations/*: pyproject.toml, README.md, src/plait/<name>/,
tests/; the distribution name is ``plait-<folder>``; no ``src/plait/__init__.py`` (PEP 420); no
``__init__.py`` in tests/ (pytest collects every package's tests together in importlib mode);
test file names carry the package name so tracebacks say whose test failed.
"""

from __future__ import annotations

import sys

from distributions import ROOT, distributions


def problems() -> list[str]:
    """Every violation found, as readable lines."""
    found = []
    for folder in [*sorted((ROOT / "packages").glob("*")), *sorted((ROOT / "integrations").glob("*"))]:
        if folder.is_dir() and not (folder / "pyproject.toml").is_file():
            found.append(f"{folder.relative_to(ROOT)}: no pyproject.toml")
    for dist in distributions():
        rel = dist.folder.relative_to(ROOT)
        expected_name = f"plait-{dist.folder.name}"
        if dist.name != expected_name:
            found.append(f"{rel}: distribution is named {dist.name!r}; design.md wants {expected_name!r}")
        module = dist.folder / "src" / "plait" / dist.import_name.split(".", 1)[1]
        parts = (("README.md", (dist.folder / "README.md").is_file()),
                 ("tests/", (dist.folder / "tests").is_dir()),
                 (f"src/plait/{module.name}/", module.is_dir()))
        for part, ok in parts:
            if not ok:
                found.append(f"{rel}: missing {part}")
        if (dist.folder / "src" / "plait" / "__init__.py").exists():
            found.append(f"{rel}: src/plait/__init__.py breaks the plait namespace (PEP 420); delete it")
        tests = dist.folder / "tests"
        if (tests / "__init__.py").exists():
            found.append(f"{rel}: tests/__init__.py must not exist (pytest runs in importlib mode)")
        short = dist.folder.name.replace("-", "_")
        for test in tests.glob("test_*.py") if tests.is_dir() else []:
            if not test.name.startswith(f"test_{short}"):
                found.append(f"{rel}: {test.name} should be named test_{short}_*.py")
    return found


def main() -> int:
    """Print problems; exit 1 if any."""
    found = problems()
    for line in found:
        print(f"layout: {line}")
    print(f"layout: {len(distributions())} distributions checked, {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
