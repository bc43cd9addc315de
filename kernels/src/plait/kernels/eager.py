"""Code that ``torch.compile`` never traces, marked without importing ``torch._dynamo`` at import time.

``@torch.compiler.disable`` imports ``torch._dynamo`` when it is applied, and at module level that
costs every process which imports plait's collectives or the ZeRO engine about as much CPU time as
importing torch itself (1.6 of 3.5 CPU-seconds), in every torchrun worker, rank and script that
never compiles anything. :func:`eager_only` marks the same functions for the same effect and
leaves the import to whatever compiles: nothing can trace a function before ``torch._dynamo`` is
imported, so the wrapper calls the function directly until then and through
``torch.compiler.disable`` after.

How the compiler sees a marked function, as it sees one disabled by torch itself:

* tracing a caller, dynamo refuses to inline it (the ``_torchdynamo_disable`` attribute it reads on
  every function it would inline) and breaks the graph at the call;
* the call then runs eagerly, and the wrapper's own frame is never handed to dynamo (its code is
  marked "skip" in the frame evaluator, which is part of torch's C extension and loads with torch);
* inside, ``torch.compiler.disable(fn)`` keeps dynamo off every frame ``fn`` calls, as the
  decorator always did.

Where torch lacks the frame evaluator's skip marking (an older or newer torch), :func:`eager_only`
is ``torch.compiler.disable`` itself, and the import happens as before.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_DYNAMO = "torch._dynamo"


def _skip_frames_of(code: types.CodeType) -> bool:
    """Tell the frame evaluator never to hand frames of ``code`` to dynamo (what
    ``torch._dynamo.eval_frame.skip_code`` does), without importing ``torch._dynamo``.

    Returns:
        ``False`` where this torch has no such marking, so the caller falls back.
    """
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return False
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    return True


def _lazy(fn: F) -> F:
    """``fn`` behind a wrapper that goes through ``torch.compiler.disable`` once dynamo is loaded."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def eager_only_call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if _DYNAMO not in sys.modules:  # nothing compiles before dynamo is imported
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    # Read by dynamo before it inlines a call: the call becomes a graph break, as for torch's own.
    eager_only_call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return eager_only_call  # type: ignore[return-value]


# Every wrapper shares one code object (a closure of the same function): marked once, here.
_LAZY = _skip_frames_of(_lazy(lambda: None).__code__)


def eager_only(fn: F) -> F:
    """Mark ``fn`` as never traced by ``torch.compile``: the effect of ``@torch.compiler.disable``
    (a call from compiled code is a graph break and runs eagerly, with every function it calls),
    without importing ``torch._dynamo`` until something compiles.

    Args:
        fn: a function or a method (decorate it in the class body).

    Returns:
        The wrapper (``functools.wraps`` of ``fn``); ``torch.compiler.disable(fn)`` where this torch
        cannot mark the wrapper's frames as skipped.
    """
    if not _LAZY:
        return torch.compiler.disable(fn)
    return _lazy(fn)
