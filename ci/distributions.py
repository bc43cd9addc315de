"""The plait distributions in this checkout, read from their pyproject files (used by the CI checks)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Distribution:
    """One distribution folder and what its pyproject declares."""

    folder: Path
    name: str
    dependencies: tuple[str, ...]

    @property
    def import_name(self) -> str:
        """docs/conventions.md's rule: the first ``-`` becomes ``.``, the rest ``_``."""
        head, _, tail = self.name.partition("-")
        return f"{head}.{tail.replace('-', '_')}"

    @property
    def plait_dependencies(self) -> tuple[str, ...]:
        """Names of the plait distributions it requires."""
        names = (re.split(r"[\s\[<>=!~;]", dep, maxsplit=1)[0].lower() for dep in self.dependencies)
        return tuple(name for name in names if name.startswith("plait-"))


def distributions() -> list[Distribution]:
    """kernels/, packages/*, integrations/* that have a pyproject.toml."""
    folders = [ROOT / "kernels", *sorted((ROOT / "packages").glob("*")), *sorted((ROOT / "integrations").glob("*"))]
    found = []
    for folder in folders:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            project = tomllib.loads(pyproject.read_text())["project"]
            found.append(Distribution(folder, project["name"], tuple(project.get("dependencies", []))))
    return found
