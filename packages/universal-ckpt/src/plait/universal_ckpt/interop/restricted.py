"""A restricted unpickler for foreign checkpoints: inert data only, never a callable of the file's choice.

DeepSpeed's ``.pt`` files are pickles. Read with ``torch.load(weights_only=False)``, a crafted one
runs any function it names. This unpickler resolves only torch's own ``weights_only`` globals
(tensor rebuilders, dtypes, ``OrderedDict``...), plait's safe-type allowlist, and classes under the
named foreign packages, which it replaces with an inert stand-in that just keeps its arguments
and state. Any other global is refused with its ``module.qualname`` and the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from plait.universal_ckpt.errors import UnsafeObjectError
from plait.universal_ckpt.safe_objects import allowed_globals


class StandIn:
    """Replaces a foreign class found in a pickle: keeps its constructor args and state, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __int__(self) -> int:
        return int(self.args[0])


def _safe_names() -> dict[str, Any]:
    from torch import _weights_only_unpickler as wo  # torch's own list of what weights_only=True resolves

    names = dict(wo._get_allowed_globals())
    names.update({f"{g.__module__}.{g.__qualname__}": g for g in allowed_globals()})
    return names


def pickle_module(stand_in_packages: tuple[str, ...], file: Path, extra: tuple[type, ...] = ()) -> Any:
    """A ``pickle_module`` for ``torch.load`` that resolves only safe globals.

    Args:
        stand_in_packages: top-level packages whose classes become :class:`StandIn` subclasses
            (e.g. ``("deepspeed",)``), so the package need not be installed and none of its code runs.
        file: the file being read, named in the error.
        extra: further classes to resolve as themselves (plain data classes of the format, e.g.
            DCP's metadata dataclasses), named by ``module.qualname``.

    Returns:
        An object with ``Unpickler`` and ``load``, as ``torch.load(pickle_module=...)`` expects.
    """
    safe = _safe_names()
    safe.update({f"{cls.__module__}.{cls.__qualname__}": cls for cls in extra})

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module.split(".")[0] in stand_in_packages:
                return type(name, (StandIn,), {})
            found = safe.get(f"{module}.{name}")
            if found is None:
                raise UnsafeObjectError(
                    f"{file} names the global {module}.{name}, which plait does not load from a foreign "
                    "checkpoint (only tensors, containers, numbers, strings and inert stand-ins for "
                    f"{', '.join(stand_in_packages) or 'no foreign'} classes); refusing the file, nothing was run.",
                    key_path=str(file), type_name=f"{module}.{name}")
            return found

    class Module:
        __name__ = "plait_restricted_pickle"

        @staticmethod
        def load(handle: Any, **kwargs: Any) -> Any:
            return Unpickler(handle, **kwargs).load()

    Module.Unpickler = Unpickler
    return Module


def load(path: Path, stand_in_packages: tuple[str, ...]) -> Any:
    """``torch.load`` of a foreign ``.pt`` file through the restricted unpickler (CPU, memory-mapped).

    Raises:
        UnsafeObjectError: the file names a global outside the safe set (names it and the file).
    """
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True,
                      pickle_module=pickle_module(stand_in_packages, Path(path)))
