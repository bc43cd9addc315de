"""Raising an I/O failure on every rank together.

A rank that cannot write its offloaded state must not simply raise: the other ranks would wait
forever in their next collective. Every offloaded step therefore ends with one tiny all-reduce of
a failure flag over the world, after which all ranks raise (the failing one its own error, the
others an :class:`~plait.offload_io.errors.OffloadDiskFullError` naming another rank) or none does.
The all-reduce is named (``offload I/O failure agreement (<what>)``) in plait's flight log, so a
rank that never reaches it is named in the others' :class:`~plait.kernels.collectives.CollectiveError`.
"""

from __future__ import annotations

import errno

import torch
import torch.distributed as dist

from plait.offload_io.errors import OffloadDiskFullError


def raise_together(errors: list[BaseException], *, what: str, path: str | None) -> None:
    """Raise ``errors[0]`` on this rank, and a disk-full error on every other rank, if any rank failed.

    Collective when ``torch.distributed`` is initialised with more than one rank: every rank
    must call it at the same point (one all-reduce of one float).

    Args:
        errors: this rank's failures (empty when it had none).
        what: what could not be written, for the other ranks' message.
        path: the offload directory, for the other ranks' error.

    Raises:
        The first of ``errors``, or :class:`OffloadDiskFullError` when only another rank failed.
    """
    failed = bool(errors)
    if dist.is_initialized() and dist.get_world_size() > 1:
        from plait.kernels import collectives

        flag = torch.tensor([float(failed)])
        collectives.all_reduce(flag, op=dist.ReduceOp.MAX, name=f"offload I/O failure agreement ({what})")
        if flag.item() > 0 and not failed:
            raise OffloadDiskFullError(errno.ENOSPC, f"another rank could not write its {what} (disk full); the "
                                       "step was applied everywhere", path=path)
    if errors:
        raise errors[0]


__all__ = ["raise_together"]
