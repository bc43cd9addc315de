"""R2's fault for every package: ``Fault("diskfull", ...)`` makes one rank's writes fail as on a full disk.

The fault caps the file size of the process (``RLIMIT_FSIZE``) from its step on; a write past the
cap fails with ``OSError(EFBIG)`` (not a SIGXFSZ kill), files written before stay intact, and
``lift_disk_full`` gives the space back. Run on two ranks, so the other rank is shown unaffected.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from plait.kernels.testing import Fault, lift_disk_full, run_distributed

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")

PAYLOAD = b"x" * 16384


def _write_each_step(directory: str, fault_text: str) -> dict:
    """Write a 16 KiB file per step; report which steps failed and how, then recover."""
    fault, rank = Fault.parse(fault_text), dist.get_rank()
    out: dict = {"failed": {}, "written": []}
    for step in range(4):
        fault.maybe_inject(step)
        path = Path(directory, f"rank{rank}-step{step}.bin")
        try:
            with open(path, "wb") as file:
                file.write(PAYLOAD)
            out["written"].append(step)
        except OSError as exc:
            out["failed"][step] = exc.errno
    out["earlier_intact"] = Path(directory, f"rank{rank}-step1.bin").read_bytes() == PAYLOAD
    lift_disk_full()
    Path(directory, f"rank{rank}-again.bin").write_bytes(PAYLOAD)
    out["after_lift"] = Path(directory, f"rank{rank}-again.bin").read_bytes() == PAYLOAD
    return out


def test_disk_full_fault_fails_writes_from_its_step_on_one_rank(tmp_path):
    fault = Fault(kind="diskfull", rank=1, step=2, nbytes=4096)
    assert Fault.parse(str(fault)) == fault and str(fault).endswith(":nbytes=4096")
    rank0, rank1 = run_distributed(_write_each_step, 2, str(tmp_path), str(fault), timeout=60)
    assert rank0["written"] == [0, 1, 2, 3] and rank0["failed"] == {}
    assert rank1["written"] == [0, 1] and rank1["failed"] == {2: errno.EFBIG, 3: errno.EFBIG}
    assert rank1["earlier_intact"] and rank1["after_lift"]
    with pytest.raises(ValueError, match="nbytes"):
        Fault(kind="diskfull", rank=0, step=0, nbytes=-1)
