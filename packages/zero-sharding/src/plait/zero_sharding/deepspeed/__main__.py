"""``python -m plait.zero_sharding.deepspeed SCRIPT ARGS``: run a DeepSpeed script on plait, unedited.

For this run only, ``import deepspeed`` (and ``deepspeed.zero`` etc.) resolves to
:mod:`plait.zero_sharding.deepspeed`, whether DeepSpeed is installed or not; a DeepSpeed
submodule the shim does not have raises ``ImportError`` naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import runpy
import sys
from typing import Any

SHIM = "plait.zero_sharding.deepspeed"


class ShimFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` and ``deepspeed.X`` as the shim and its submodules (first on ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        """Return the shim's spec for ``deepspeed[.X]``; ``None`` for any other name."""
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        target_name = SHIM + fullname[len("deepspeed"):]
        if importlib.util.find_spec(target_name) is None:
            raise ImportError(f"{fullname} is not provided by plait's DeepSpeed shim ({SHIM}); the shim has "
                              "initialize, init_distributed, add_config_arguments and zero (Init, "
                              "GatheredParameters).", name=fullname)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(target_name))


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        return None


def install() -> None:
    """Make ``import deepspeed`` resolve to the shim in this process (drops an already-imported deepspeed)."""
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]
    if not any(isinstance(finder, ShimFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, ShimFinder())


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]`` (a script path) as ``__main__`` with the remaining arguments and the shim installed.

    Raises:
        SystemExit: no script given.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m plait.zero_sharding.deepspeed SCRIPT.py [ARGS...]")
    install()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
