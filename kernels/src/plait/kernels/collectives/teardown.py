"""A finished run exits 0: no gloo worker frees a Python tensor while the interpreter shuts down.

The abort this prevents ("terminate called without an active exception", SIGABRT, after the
job's last line ran) was caught in a core dump of a four-rank ZeRO run that had finished and
called ``destroy_process_group``: a gloo worker thread (``pt_gloo_runloop``) was destroying the
work object of the job's last broadcast while the main thread was already in ``Py_FinalizeEx``.
A work object holds the collective's tensors; freeing a tensor that has a Python object needs
the GIL, and a thread that asks for the GIL after finalization has begun is ended with
``pthread_exit``, whose forced unwind through torch's ``noexcept`` destructors calls
``std::terminate``. The worker drops its reference to the work just *after* marking it complete,
so ``wait()`` can return, the program can end, and the worker's drop can still come later on a
loaded machine (pytorch/pytorch#190489 is the same race, open upstream).

The remedy: the caller keeps the last work of each process group (by its flight-log name) until
the next collective on that group, or until the process ends. Then the worker's drop is never
the last reference, and the work is freed by the main thread, which holds the GIL even during
finalization. Only works whose tensors are small are kept (:data:`KEEP_MAX_BYTES`): a kept work
also keeps its tensors' memory, and a job's last collectives (a checkpoint's commit broadcast, a
loss all-reduce, a barrier) are small. Before the interpreter finalizes, :func:`_drain_at_exit`
also gives the workers a moment without the GIL, for the large works that were not kept.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

import torch

# Works whose tensors together hold at most this many bytes are kept (1 MiB: every control
# collective, never a ZeRO unit's gradients or a gathered parameter).
KEEP_MAX_BYTES = 1 << 20
# How long exit lets the workers run without the GIL, and in how many slices.
DRAIN_S, DRAIN_SLICES = 0.02, 4

_kept: dict[str, Any] = {}


def tensors_nbytes(values: Any) -> int:
    """Bytes held by the tensors among ``values`` (tensors, and lists or tuples of them)."""
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += tensors_nbytes(value)
    return total


def keep(group_label: str, work: Any, nbytes: int) -> None:
    """Hold ``work`` (torch's handle of a finished collective on ``group_label``) until the next
    collective on that group, so no gloo worker frees it; works over :data:`KEEP_MAX_BYTES` only
    release the previous one."""
    _kept.pop(group_label, None)  # freed here, by this thread, while the interpreter is alive
    if nbytes <= KEEP_MAX_BYTES:
        _kept[group_label] = work


def kept() -> dict[str, Any]:
    """The works kept now, by group (for tests)."""
    return dict(_kept)


@atexit.register
def _drain_at_exit() -> None:
    # atexit runs before finalization begins: a worker still freeing a work that was not kept
    # gets the GIL here, where taking it is safe.
    for _ in range(DRAIN_SLICES):
        time.sleep(DRAIN_S / DRAIN_SLICES)
