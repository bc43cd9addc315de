"""docs/architecture.md states facts about the code; this keeps the checkable ones true.

- which feature packages ship a ``ShardingExtension``: every class named in the table's column
  satisfies the protocol, every extension class the feature packages define is named there, the
  order each cell states is the class's, and the prose names the same packages;
- what each distribution requires, offers as extras and registers as entry points: the table
  between the ``distributions`` markers is rendered from the ``pyproject.toml`` files;
- that feature packages import no other feature package at module level, and which ones they import
  inside functions: the list between the ``lazy-imports`` markers is found by reading the sources.

``python tests/test_architecture_page.py`` prints both generated blocks, to paste after a change.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


def _block(name: str) -> str:
    """The page's text between ``<!-- name: start -->`` and ``<!-- name: end -->``."""
    text = PAGE.read_text()
    return text.split(f"<!-- {name}: start -->\n")[1].split(f"<!-- {name}: end -->")[0]


def _table() -> str:
    return _block("extensions")


def _named() -> set[str]:
    return set(re.findall(r"`(plait\.[a-z_.]+\.[A-Z]\w*Extension)`", _table()))


def _is_extension(node: ast.ClassDef) -> bool:
    """A class body with the protocol's four members (``order`` as an attribute or a method)."""
    names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    names |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return {"order", "zero_kwargs", "apply", "check"} <= names


@functools.cache
def _sources() -> tuple[tuple[Path, str, ast.Module], ...]:
    """Every feature package source file, parsed once: (package folder, dotted module, tree)."""
    parsed = []
    for folder in sorted((ROOT / "packages").glob("*")):
        src = folder / "src"
        for path in sorted(src.glob("plait/**/*.py")):
            module = ".".join(path.relative_to(src).with_suffix("").parts)
            parsed.append((folder, module, ast.parse(path.read_text())))
    return tuple(parsed)


def _defined() -> set[str]:
    """The dotted names of the extension classes the feature packages' sources define."""
    return {f"{module}.{node.name}" for _, module, tree in _sources() for node in tree.body
            if isinstance(node, ast.ClassDef) and _is_extension(node)}


def test_every_extension_named_on_the_page_follows_the_protocol() -> None:
    named = _named()
    assert named, "the page names no extension class"
    for dotted in sorted(named):
        module, name = dotted.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as exc:  # a feature package that is not installed here
            pytest.skip(f"{module} is not importable here: {exc}")
        missing = [m for m in ("order", "check", "apply", "zero_kwargs") if not hasattr(cls, m)]
        assert not missing, (dotted, missing)
        assert isinstance(cls.order, int), dotted


def test_the_page_names_every_extension_the_feature_packages_define() -> None:
    assert _defined() == _named()


def _extension_orders() -> dict[str, int]:
    """Dotted class name -> the ``order`` its class body assigns, read from the sources."""
    orders = {}
    for _, module, tree in _sources():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and _is_extension(node):
                for item in node.body:
                    if (isinstance(item, ast.Assign) and any(getattr(t, "id", "") == "order" for t in item.targets)
                            and isinstance(item.value, ast.Constant)):
                        orders[f"{module}.{node.name}"] = item.value.value
    return orders


def test_the_order_each_cell_states_is_the_classs() -> None:
    stated = dict(re.findall(r"`(plait\.[a-z_.]+\.[A-Z]\w*Extension)` \(order (\d+)", _table()))
    assert {name: int(order) for name, order in stated.items()} == _extension_orders()


def test_the_prose_names_the_packages_that_ship_an_extension() -> None:
    shipping = sorted({"plait-" + name.split(".")[1].replace("_", "-") for name in _defined()})
    sentence = re.search(r"`zero_kwargs\(\)`\); (.+?) ship", PAGE.read_text().replace("\n", " "))
    assert sentence, "the page no longer says which packages ship a ShardingExtension"
    assert sorted(re.findall(r"plait-[a-z-]+", sentence.group(1))) == shipping


def _pyprojects() -> list[Path]:
    return [ROOT / "kernels" / "pyproject.toml", *sorted((ROOT / "packages").glob("*/pyproject.toml")),
            *sorted((ROOT / "integrations").glob("*/pyproject.toml"))]


def _plait_names(requirements: list[str]) -> list[str]:
    names = (re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0] for req in requirements)
    return [name for name in names if name.startswith("plait-")]


def distributions_table() -> str:
    """The page's distributions table, rendered from every distribution's ``pyproject.toml``."""
    lines = ["| distribution | requires (plait) | optional extras with plait pieces | entry points |",
             "|---|---|---|---|"]
    for path in _pyprojects():
        project = tomllib.loads(path.read_text())["project"]
        requires = ", ".join(_plait_names(project.get("dependencies", []))) or "-"
        extras = "; ".join(f"`[{extra}]`: {', '.join(names)}"
                           for extra, reqs in project.get("optional-dependencies", {}).items()
                           if (names := _plait_names(reqs))) or "-"
        points = "; ".join(f"`{group}`: {', '.join(sorted(entries))}"
                           for group, entries in sorted(project.get("entry-points", {}).items())) or "-"
        lines.append(f"| `{project['name']}` | {requires} | {extras} | {points} |")
    return "\n".join(lines) + "\n"


def _feature_imports() -> tuple[set[str], dict[tuple[str, str], set[str]]]:
    """Module-level imports of another feature package (``package -> package: file``), and the
    imports inside functions, by (importer, imported) distribution, with the importing files."""
    at_top, inside = set(), {}
    for folder, source, tree in _sources():
        own = "plait." + folder.name.replace("-", "_")
        where = "/".join(source.split(".")[2:]) + ".py"  # the file, relative to the package's import root
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in modules:
                if not module.startswith("plait.") or module.startswith((own, "plait.kernels")):
                    continue
                target = "plait-" + module.split(".")[1].replace("_", "-")
                if id(node) in top:
                    at_top.add(f"plait-{folder.name} -> {target}: {where}")
                else:
                    inside.setdefault((f"plait-{folder.name}", target), set()).add(where)
    return at_top, inside


def lazy_imports_list() -> str:
    """The page's list of imports between feature packages inside functions, found in the sources."""
    _, inside = _feature_imports()
    return "".join(f"- {importer} -> {target}: {', '.join(f'`{w}`' for w in sorted(files))}\n"
                   for (importer, target), files in sorted(inside.items()))


def test_the_distributions_table_is_the_pyprojects() -> None:
    assert _block("distributions") == distributions_table(), (
        "regenerate the table between the distributions markers: python tests/test_architecture_page.py")


def test_feature_packages_import_one_another_only_inside_functions() -> None:
    at_top, _ = _feature_imports()
    assert not at_top, f"a feature package imports another at module level: {sorted(at_top)}"
    assert _block("lazy-imports") == lazy_imports_list(), (
        "regenerate the list between the lazy-imports markers: python tests/test_architecture_page.py")


if __name__ == "__main__":
    print(distributions_table())
    print(lazy_imports_list())
