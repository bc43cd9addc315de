"""docs/architecture.md states which feature packages ship a ``ShardingExtension``; this keeps the
statement true: every class named in that column satisfies the protocol, and every extension class
the feature packages define is named there."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


def _table() -> str:
    text = PAGE.read_text()
    return text.split("<!-- extensions: start -->")[1].split("<!-- extensions: end -->")[0]


def _named() -> set[str]:
    return set(re.findall(r"`(plait\.[a-z_.]+\.[A-Z]\w*Extension)`", _table()))


def _is_extension(node: ast.ClassDef) -> bool:
    """A class body with the protocol's four members (``order`` as an attribute or a method)."""
    names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    names |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return {"order", "zero_kwargs", "apply", "check"} <= names


def _defined() -> set[str]:
    """The dotted names of the extension classes the feature packages' sources define."""
    found = set()
    for src in (ROOT / "packages").glob("*/src"):
        for path in src.glob("plait/**/*.py"):
            module = ".".join(path.relative_to(src).with_suffix("").parts)
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and _is_extension(node):
                    found.add(f"{module}.{node.name}")
    return found


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
