"""The package's floors: every module imports only from its own floor or the ones below, and the
modules import one another without a cycle (read from the sources with ``ast``, imports inside
functions and under ``TYPE_CHECKING`` included, so a lazy import cannot hide an upward one).

Floors (the package docstring of :mod:`plait.onebit_optim` describes them):
0 ``config``; 1 ``rules``; 2 ``exchange``; 3 ``data_parallel``; 4 ``under_zero``;
5 the package itself, ``deepspeed_keys`` and ``benchmarks``.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

import plait.onebit_optim

SRC = Path(plait.onebit_optim.__file__).parent
PACKAGE = "plait.onebit_optim"
FLOORS = {"config": 0, "rules": 1, "exchange": 2, "data_parallel": 3, "under_zero": 4,
          "": 5, "deepspeed_keys": 5, "benchmarks": 5}
PUBLIC = ["CompressedOptimizer", "Lamb", "LossScaling", "OnebitAdam", "OnebitAdamConfig", "OnebitLamb",
          "OnebitLambConfig", "SettleConfig", "ZeroOneAdam", "ZeroOneAdamConfig", "config_from_dict"]


@functools.cache
def _modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name (a package by its ``__init__``), parsed."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        found[".".join((PACKAGE, *parts))] = ast.parse(path.read_text())
    return found


def _floor(module: str) -> int:
    """The floor of a module of the package, from its first component below the package."""
    first = module.removeprefix(PACKAGE).lstrip(".").split(".")[0]
    assert first in FLOORS, f"{module} is on no floor: add {first!r} to FLOORS and to the package docstring"
    return FLOORS[first]


def _imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules ``tree`` imports anywhere in it (``from pkg import submodule`` counts
    as the submodule)."""
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        targets |= {name for name in names if name == PACKAGE or name.startswith(PACKAGE + ".")}
    return targets


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(tree, set(modules)) - {name} for name, tree in modules.items()}


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    upward = sorted(f"{source} (floor {_floor(source)}) imports {target} (floor {_floor(target)})"
                    for source, targets in _graph().items() for target in targets
                    if _floor(target) > _floor(source))
    assert not upward, upward


def test_the_modules_import_one_another_without_a_cycle() -> None:
    graph, done, path = _graph(), set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        path.append(module)
        for target in sorted(graph.get(module, ())):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_every_floor_holds_modules_and_no_file_is_over_500_lines() -> None:
    modules = _modules()
    assert {_floor(m) for m in modules} == set(range(6))
    long = {p.name: n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


@pytest.mark.parametrize("name", PUBLIC)
def test_the_public_names_stay_importable_from_the_package(name: str) -> None:
    assert sorted(plait.onebit_optim.__all__) == PUBLIC
    assert getattr(importlib.import_module(PACKAGE), name) is not None


def test_the_zero_composition_hook_is_installed_by_the_package() -> None:
    from plait.onebit_optim.data_parallel import base
    from plait.onebit_optim.under_zero.compose import compose_with_zero

    assert base._zero_composition is compose_with_zero
