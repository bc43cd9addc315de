"""Emulated nodes on one machine: network namespaces joined by veth links with a ``tc`` rate limit.

Loopback between processes is not a network. As root, :func:`emulated_nodes` makes ``n``
network namespaces, one per "node". Processes of one node run inside its namespace and talk to
each other over that namespace's own loopback (a connection to the node's own address never
leaves the namespace); processes of different nodes talk over a veth link, where a token-bucket
filter (``tc qdisc ... tbf``) can hold them to a rate (:meth:`Nodes.set_rate`; ``None``:
unthrottled, the compute floor). Two nodes are joined by one veth pair (10.77.<s>.1 and .2);
more than two by one veth per node into a bridge in a further "switch" namespace.

The interface counters of each node's end (:meth:`Nodes.tx_bytes`, or
:func:`interface_tx_bytes` from a process inside the namespace) count every byte that left the
node, TCP/IP headers included: the sum over nodes is the traffic that crossed between nodes.

Everything is deleted on exit, also after an error. Where namespaces cannot be made (not root,
no ``ip``/``tc``), :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

SUBNET_PREFIX = "10.77"


@dataclasses.dataclass
class Nodes:
    """The namespaces ("nodes") and the links between them.

    Attributes:
        namespaces: one namespace name per node (node 0 first).
        devices: each node's end of its link (the interface inside the node's namespace).
        addresses: each node's IPv4 address on that interface.
        switch_devices: the switch namespace's end of each node's link (more than two nodes;
            empty for two, where the two ends face each other).
        switch_namespace: the namespace holding the bridge, or ``None`` for two nodes.
    """

    namespaces: tuple[str, ...]
    devices: tuple[str, ...]
    addresses: tuple[str, ...]
    switch_devices: tuple[str, ...] = ()
    switch_namespace: str | None = None

    def set_rate(self, rate: str | None) -> None:
        """Hold every direction between nodes to ``rate`` (tc syntax, e.g. ``"1gbit"``); ``None``: unlimited."""
        ends = list(zip(self.namespaces, self.devices))
        if self.switch_namespace is not None:  # a node's download leaves through its switch port
            ends += [(self.switch_namespace, dev) for dev in self.switch_devices]
        for ns, dev in ends:
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                # Burst: at least one timer tick's worth of bytes at this rate (HZ >= 100), else tbf
                # cannot reach its rate; the latency bounds the queue.
                burst = max(rate_bits(rate) // 8 // 100, 64 * 1024)
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "50ms")

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def tx_bytes(self, node: int) -> int:
        """Bytes sent so far by node ``node`` towards the other nodes (its link end's counter)."""
        out = _run("ip", "-n", self.namespaces[node], "-s", "-j", "link", "show", "dev", self.devices[node])
        return parse_link_stats(out.stdout)[0]

    def total_tx_bytes(self) -> int:
        """Bytes sent so far by all nodes to each other: each byte that crossed between nodes once."""
        return sum(self.tx_bytes(node) for node in range(len(self.namespaces)))


Link = Nodes  # the two-node name the onebit-optim benchmark was written against


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as ``"1gbit"`` or ``"100mbit"``.

    Raises:
        ValueError: not written as ``<number>gbit|mbit|kbit``.
    """
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            try:
                return int(float(rate[: -len(unit)]) * factor)
            except ValueError:
                break
    raise ValueError(f"rate={rate!r}: write it as tc does, e.g. '1gbit' or '100mbit'.")


def parse_link_stats(text: str) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` from the output of ``ip -s -j link show dev DEV``.

    Raises:
        ValueError: the text is not that output (no ``stats64``/``stats`` of one interface).
    """
    try:
        entries = json.loads(text)
        stats = entries[0].get("stats64") or entries[0]["stats"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])
    except (json.JSONDecodeError, LookupError, TypeError, AttributeError) as exc:
        raise ValueError(f"not the output of `ip -s -j link show dev DEV`: {text[:200]!r}") from exc


def interface_tx_bytes(device: str, *, sys_root: str | Path = "/sys/class/net") -> int:
    """Bytes sent so far by ``device``, read from sysfs by a process inside its namespace
    (``ip netns exec`` mounts the namespace's own ``/sys``, so its children see their devices).

    Raises:
        FileNotFoundError: no such interface here (``device`` is in another namespace).
    """
    return int(Path(sys_root, device, "statistics", "tx_bytes").read_text())


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here, or ``None`` when they can (probably)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN (run as root, e.g. sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed (iproute2)"
    return None


def plan(count: int, tag: str, subnet: int) -> Nodes:
    """The names and addresses :func:`emulated_nodes` uses for ``count`` nodes (nothing is created).

    Raises:
        ValueError: fewer than two nodes, more than 200, or a ``tag`` too long for interface names.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= 200:
        raise ValueError(f"count={count!r}: emulate between 2 and 200 nodes.")
    if len(tag) > 9:  # interface names hold 15 characters: tag + "v" + up to 3 digits + ...
        raise ValueError(f"tag={tag!r} is longer than 9 characters; interface names would not fit.")
    namespaces = tuple(f"{tag}n{i}" for i in range(count))
    addresses = tuple(f"{SUBNET_PREFIX}.{subnet}.{i + 1}" for i in range(count))
    devices = tuple(f"{tag}v{i}" for i in range(count))
    if count == 2:
        return Nodes(namespaces, devices, addresses)
    return Nodes(namespaces, devices, addresses, tuple(f"{tag}s{i}" for i in range(count)), f"{tag}sw")


@contextlib.contextmanager
def emulated_nodes(count: int = 2, *, prefix: str = "plt") -> Iterator[Nodes]:
    """Create ``count`` namespaces and the links between them; delete them all on exit.

    Args:
        count: how many nodes.
        prefix: up to 4 characters starting the names (the process id follows, so two runs
            at once do not collide).

    Yields:
        The :class:`Nodes` (unthrottled until :meth:`Nodes.set_rate`).

    Raises:
        RuntimeError: they could not be created (the message carries ``ip``'s error).
        ValueError: see :func:`plan`.
    """
    nodes = plan(count, f"{prefix[:4]}{os.getpid() % 100000}", os.getpid() % 200 + 20)
    created: list[str] = []
    try:
        for ns in (*nodes.namespaces, *([nodes.switch_namespace] if nodes.switch_namespace else [])):
            _run("ip", "netns", "add", ns)
            created.append(ns)
        if nodes.switch_namespace is None:
            _run("ip", "link", "add", nodes.devices[0], "type", "veth", "peer", "name", nodes.devices[1])
        else:
            _make_switch(nodes)
        for ns, dev, addr in zip(nodes.namespaces, nodes.devices, nodes.addresses):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield nodes
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"could not create the emulated nodes: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
    finally:
        for ns in created:  # deleting a namespace deletes its veth ends, and their peers with them
            _run("ip", "netns", "del", ns, check=False)
        if created:  # a pair that failed before it moved into a namespace is still in the root one
            for dev in nodes.devices:
                _run("ip", "link", "del", dev, check=False)


def _make_switch(nodes: Nodes) -> None:
    """A bridge in the switch namespace with one veth per node (the node's end stays in the root
    namespace until the caller moves it)."""
    sw = nodes.switch_namespace
    assert sw is not None
    _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", sw, "link", "set", "br0", "up")
    for dev, port in zip(nodes.devices, nodes.switch_devices):
        _run("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
        _run("ip", "link", "set", port, "netns", sw)
        _run("ip", "-n", sw, "link", "set", port, "master", "br0")
        _run("ip", "-n", sw, "link", "set", port, "up")


@contextlib.contextmanager
def emulated_link() -> Iterator[Nodes]:
    """Two nodes (the onebit-optim benchmark's link): :func:`emulated_nodes` with ``count=2``."""
    with emulated_nodes(2, prefix="pob") as nodes:
        yield nodes
