"""plait-kernels: the common package every plait distribution builds on.

* :mod:`plait.kernels.ops` - Triton kernels with pure-torch references (``rms_norm`` is the pattern).
* :mod:`plait.kernels.dispatch` - which path an op takes (``PLAIT_KERNEL_BACKEND``).
* :mod:`plait.kernels.collectives` - ``torch.distributed`` wrappers and the byte ledger.
* :mod:`plait.kernels.sharded_state` - how sharded state describes itself to checkpoints.
* :mod:`plait.kernels.mesh` - named device meshes from sizes.
* :mod:`plait.kernels.testing` - the gloo harness, tiny-llama, the built-in corpus.
* :mod:`plait.kernels.bench` - benchmark rows, interleaved timing, tables.
* :mod:`plait.kernels.progress` - progress bars on a terminal, one plain line in logs.

Submodules are imported on first use, so ``import plait.kernels`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("bench", "collectives", "dispatch", "mesh", "ops", "progress", "settings", "sharded_state", "testing",
               "tolerances")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"plait.kernels.{name}")
    raise AttributeError(f"module 'plait.kernels' has no attribute {name!r}")


__all__ = list(_SUBMODULES)
