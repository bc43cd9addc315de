"""``plait bench offload-io``: the I/O engine and the offloaded step against their peers."""
