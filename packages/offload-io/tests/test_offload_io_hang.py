"""R8/R9 for offload-io: a rank that never reaches the offload failure agreement is named.

Every offloaded step ends with one all-reduce of a failure flag (``raise_together``). When one
rank never gets there (stuck, or dead), the others' collective times out; their error must name
that rank and the collective, within the job's collective timeout and a few seconds more.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.testing import Fault, run_distributed
from plait.offload_io import AsyncIOEngine, FileShardStorage, IOConfig

SHORT = datetime.timedelta(seconds=4)  # the job's collective timeout under test


def _steps_with_a_missing_rank(directory: str, fault_text: str) -> tuple[str, float]:
    """Each step writes one offloaded parameter shard and agrees on failures; the fault's rank
    stops before step 2's agreement (as a stuck rank would)."""
    dist.distributed_c10d._set_pg_timeout(SHORT)  # the default group carries the job's timeout
    fault = Fault.parse(fault_text)
    engine = AsyncIOEngine(IOConfig(block_size=65536, queue_depth=4, workers=1, fsync=False))
    storage = FileShardStorage(f"{directory}/rank{dist.get_rank()}", engine=engine)
    entered = time.time()
    try:
        for step in range(4):
            collectives.set_step(step)
            storage.write("layers.0", torch.full((4096,), float(step))).wait()
            if fault.fires(step, dist.get_rank()):
                fault.maybe_inject(step)
                return "skipped", 0.0
            entered = time.time()
            storage.finish_step([])
    except collectives.CollectiveError as exc:
        assert sorted(exc.missing) == [1], exc.missing
        return str(exc), time.time() - entered
    finally:
        collectives.set_step(None)
        storage.close()
        engine.close()
    return "finished", 0.0


def test_a_rank_missing_the_failure_agreement_is_named(tmp_path):
    (message, seconds), (skipped, _) = run_distributed(
        _steps_with_a_missing_rank, 2, str(tmp_path), "hang:rank=1:step=2:seconds=8", timeout=40)
    assert skipped == "skipped"
    assert message.startswith("rank 1 did not enter offload I/O failure agreement (parameter shards) (step 2;")
    assert "its last collective was offload I/O failure agreement (parameter shards) (step 1;" in message
    print(f"offload-io: rank 1 named {seconds:.1f} s after rank 0 entered the agreement")
    # the 4 s timeout, one 0.5 s report interval and 0.3 s of waiting for fresh reports, plus slack
    assert SHORT.total_seconds() <= seconds < SHORT.total_seconds() + 4
