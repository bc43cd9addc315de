"""Joining the default process group in a way that survives ``torchrun --max-restarts``.

Under torchrun's c10d rendezvous (``--standalone`` included) every worker's ``env://`` store is a
client of the *agent's* TCPStore, and that store outlives a restart: torch's rendezvous code
creates the client without a per-attempt prefix (its comment assumes a new store per retry). The
process group's keys (gloo's address of each rank, the store barrier's counters) are the same
names in every attempt, so a restarted rank can read the address the *previous* attempt's rank 0
published, connect to a port nobody listens on any more and fail with "Gloo connectFullMesh failed
... Connection refused" (seen here in 5 of 7 restarts on a loaded 2-core machine, torch 2.13: the
new rank 0 had not yet written its own address; 0 of 3 with the prefix below). NCCL's unique id
travels through the same store.

:func:`init_process_group` puts each attempt's keys under their own prefix
(``plait/attempt-<TORCHELASTIC_RESTART_COUNT>/``), so an attempt only ever sees its own ranks.
Outside torchelastic it is ``torch.distributed.init_process_group`` unchanged.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt or
    outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _agent_store(timeout: datetime.timedelta) -> dist.Store | None:
    """A client of torchrun's agent store with this attempt's prefix, or None outside torchelastic."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"plait/attempt-{restart_count()}/", store)


def init_process_group(backend: str | None = None, *, timeout: datetime.timedelta, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment, safe across restarts.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ... (``None``: torch's default for the devices present).
        timeout: the collective timeout of the default group (and of the store).
        kwargs: passed on to ``torch.distributed.init_process_group`` (``device_id``, ...);
            not ``store``, ``rank`` or ``world_size``, which come from torchrun's environment.

    Raises:
        ValueError: ``kwargs`` holds ``store``, ``rank``, ``world_size`` or ``init_method``.
    """
    clash = sorted(set(kwargs) & {"store", "rank", "world_size", "init_method"})
    if clash:
        raise ValueError(f"init_process_group({', '.join(clash)}=...) is set from torchrun's environment here; "
                         "call torch.distributed.init_process_group directly to choose it yourself.")
    store = _agent_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, **kwargs)


__all__ = ["init_process_group", "restart_count"]
