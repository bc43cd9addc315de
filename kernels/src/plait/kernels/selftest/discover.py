"""Finding every distribution's selftest checks: from entry points when plait is installed, else by
import name in the ``plait`` namespace (how the command runs from a source tree on PYTHONPATH, as
on a lent GPU machine where nothing is installed).

Contract: a distribution contributes ``checks(ctx) -> list[Check]``, either as the entry point
``[project.entry-points."plait.selftest"] NAME = "module:checks"`` or as a module
``plait.<package>.selftest`` (or a package of that name) that defines ``checks``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from plait.kernels.cli.registry import plait_distributions
from plait.kernels.selftest.core import FAIL, Check, Outcome, SelftestContext

GROUP = "plait.selftest"


@dataclasses.dataclass(frozen=True)
class Discovered:
    """What discovery found.

    Attributes:
        how: ``"entry points (plait.selftest)"`` or ``"import names (plait.*.selftest)"``.
        providers: provider name -> its ``checks`` callable (or the import error, as a string).
    """

    how: str
    providers: dict[str, Callable[[SelftestContext], list[Check]] | str]


def _from_entry_points() -> dict[str, Callable | str]:
    from plait.kernels.cli.registry import entry_points

    found: dict[str, Callable | str] = {}
    for name, ep in sorted(entry_points(GROUP).items(), key=lambda item: (item[0] != "kernels", item[0])):
        try:
            found[name] = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken provider becomes one FAIL row
            found[name] = f"{ep.value} failed to import: {type(exc).__name__}: {exc}"
    return found


def _selftest_packages() -> list[str]:
    """Names of the packages in the ``plait`` namespace that hold a ``selftest`` module, read from
    the namespace's folders (so that packages without one, such as the integrations, whose
    ``__init__`` imports Lightning or vLLM, are not imported just to look)."""
    import plait

    folders = [child for entry in plait.__path__ if Path(entry).is_dir() for child in Path(entry).iterdir()]
    # An editable install's namespace entries are path hooks, not folders: locate the packages of
    # the installed plait distributions through their import specs instead.
    for dist in plait_distributions():
        spec = importlib.util.find_spec(dist.import_name) if "." in dist.import_name else None
        folders += [Path(location) for location in (spec.submodule_search_locations or [])] if spec else []
    names = {folder.name for folder in folders
             if (folder / "selftest.py").is_file() or (folder / "selftest" / "__init__.py").is_file()}
    # plait-kernels first (its op rows are the base the others build on), then by name
    return sorted(names, key=lambda name: (name != "kernels", name))


def _from_import_names() -> dict[str, Callable | str]:
    found: dict[str, Callable | str] = {}
    for name in _selftest_packages():
        module_name = f"plait.{name}.selftest"
        try:
            found[name] = importlib.import_module(module_name).checks
        except Exception as exc:  # noqa: BLE001 - a broken provider becomes one FAIL row
            found[name] = f"{module_name} failed to import: {type(exc).__name__}: {exc}"
    return found


def discover(source: str = "auto") -> Discovered:
    """Find every provider of selftest checks.

    Args:
        source: ``"entry-points"``, ``"import-names"`` or ``"auto"`` (entry points when any
            distribution declares the group, else import names).

    Returns:
        A :class:`Discovered`.

    Raises:
        ValueError: ``source`` is not one of the three.
    """
    if source not in ("auto", "entry-points", "import-names"):
        raise ValueError(f"source={source!r}; pass 'auto', 'entry-points' or 'import-names'.")
    if source != "import-names":
        found = _from_entry_points()
        if found or source == "entry-points":
            return Discovered("entry points (plait.selftest)", found)
    return Discovered("import names (plait.*.selftest; no plait.selftest entry points installed)",
                      _from_import_names())


def all_checks(found: Discovered, ctx: SelftestContext) -> list[Check]:
    """Every provider's checks in provider order; a provider that fails to import or to list its
    checks contributes one FAIL row that says why."""
    checks: list[Check] = []
    for name, provider in found.providers.items():
        if isinstance(provider, str):
            checks.append(Check(f"{name}/import", lambda _ctx, why=provider: Outcome(FAIL, note=why), 1))
            continue
        try:
            checks.extend(provider(ctx))
        except Exception as exc:  # noqa: BLE001
            why = f"checks() raised {type(exc).__name__}: {exc}"
            checks.append(Check(f"{name}/checks", lambda _ctx, why=why: Outcome(FAIL, note=why), 1))
    return checks
