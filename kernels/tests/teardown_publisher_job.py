"""A process that ends while its flight-log publisher is inside a torch store call (run by
test_kernels_teardown.py).

The publisher's report is made a store ``get`` of a key nobody writes, with a 2 s store timeout:
the stand-in for a report that a loaded machine (or a slow store host) holds for longer than
usual. Then the main thread finishes, and an object freed at interpreter teardown takes 4 s (as
freeing large buffers or joining I/O workers can). Python 3.11 ends a daemon thread that wakes up
during finalization with ``pthread_exit``; unwinding through torch's C++ binding frames then
calls ``std::terminate``: "terminate called without an active exception", SIGABRT. Exit code 0
means the publisher had left the store call before teardown began.
"""

from __future__ import annotations

import datetime
import time
from time import sleep

import torch.distributed as dist

from plait.kernels.collectives import hangs


class SlowTeardown:
    """Freed at interpreter teardown, slowly."""

    def __del__(self, sleep=sleep) -> None:  # the module's globals are gone by then: keep sleep
        sleep(4.0)


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=2),
                          wait_for_workers=False)
    hangs._Publisher.publish = lambda self: store.get("a key nobody writes")  # blocks 2 s in C++, then raises
    hangs._publisher = hangs._Publisher(store, 0, 0.05)
    time.sleep(0.3)  # the publisher is inside the store call now
    print("main thread done", flush=True)


slow = SlowTeardown()
if __name__ == "__main__":
    main()
