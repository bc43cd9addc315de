"""Layout check: every distribution has the parts docs/conventions.md names ("Layout of a
distribution"), and names map as it says.

For each of kernels/, packages/*, integrations/*: pyproject.toml, README.md, src/plait/<name>/,
tests/; the distribution name is ``plait-<folder>``; no ``src/plait/__init__.py`` (PEP 420); no
``__init__.py`` in tests/ (pytest collects every package's tests together in importlib mode);
test file names carry the package name so tracebacks say whose test failed; a distribution's
tests import no plait distribution it does not declare (tests of two or more pieces together live
in the top-level tests/, whose files are named test_<topic>.py), so the install-alone check can
run each distribution's tests where only it and its declared dependencies are installed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

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
            found.append(f"{rel}: distribution is named {dist.name!r}; docs/conventions.md wants {expected_name!r}")
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
        allowed = {dist.import_name, *(_import_name(dep) for dep in dist.plait_dependencies)}
        for source in sorted(tests.rglob("*.py")) if tests.is_dir() else []:
            for module in sorted(plait_imports(source) - allowed):
                found.append(f"{source.relative_to(ROOT)} imports {module}, which {dist.name} does not declare; "
                             f"move the test to the top-level tests/ (cross-package suite)")
    found.extend(_top_level_problems(ROOT / "tests"))
    return found


def _import_name(distribution: str) -> str:
    head, _, tail = distribution.partition("-")
    return f"{head}.{tail.replace('-', '_')}"


def plait_imports(source: Path) -> set[str]:
    """The plait packages (``plait.<name>``) a Python file imports, at any depth, importorskip included."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if node.module == "plait" else node.module for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("importorskip", "import_module") and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]
        found.update(".".join(name.split(".")[:2]) for name in names if name.startswith("plait."))
    return found


def _top_level_problems(tests: Path) -> list[str]:
    """The cross-package suite: plain test_<topic>.py files, no __init__.py."""
    if not tests.is_dir():
        return []
    found = []
    if (tests / "__init__.py").exists():
        found.append("tests/__init__.py must not exist (pytest runs in importlib mode)")
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
