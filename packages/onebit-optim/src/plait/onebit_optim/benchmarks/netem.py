"""An emulated slow link for the onebit-optim benchmark: two network namespaces joined by a veth
pair with a ``tc`` rate limit.

The helper lives in :mod:`plait.kernels.benchmarks.netem` (every package's benchmarks use it; the
zero-sharding two-node benchmark runs more than one rank per namespace). This module keeps the
names the suite was written against: :func:`emulated_link` yields a two-node
:class:`~plait.kernels.benchmarks.netem.Nodes` (``Link``), whose ``namespaces``, ``devices``,
``addresses``, ``set_rate`` and ``command(rank, argv)`` are as before.
"""

from plait.kernels.benchmarks.netem import Link, Nodes, emulated_link, rate_bits, unavailable_reason

_bits = rate_bits  # the former private name

__all__ = ["Link", "Nodes", "emulated_link", "unavailable_reason"]
