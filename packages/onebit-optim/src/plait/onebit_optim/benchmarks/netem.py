"""An emulated slow link: two network namespaces joined by a veth pair with a ``tc`` rate limit.

The point of 1-bit optimizers is a slow network, and loopback between two processes is not one.
As root, :func:`emulated_link` creates namespaces ``<prefix>a`` and ``<prefix>b``, a veth pair
between them (10.77.<n>.1 and .2), and a token-bucket filter (``tc qdisc ... tbf``) on both ends
at the requested rate; :meth:`Link.set_rate` changes it between runs, ``None`` removes it (the
unthrottled veth: the compute floor). Everything is deleted on exit, also after an error. Where
namespaces cannot be made (not root, no ``ip``), it says why, and the suite runs on loopback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator


@dataclasses.dataclass
class Link:
    """Two namespaces and the veth between them.

    Attributes:
        namespaces: the two namespace names (rank 0 runs in the first).
        devices: the veth end in each namespace.
        addresses: each end's IPv4 address.
    """

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]

    def set_rate(self, rate: str | None) -> None:
        """Limit both directions to ``rate`` (tc syntax, e.g. ``"1gbit"``); ``None``: unlimited."""
        for ns, dev in zip(self.namespaces, self.devices):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                # Burst: at least one timer tick's worth of bytes at this rate (HZ >= 100), else tbf
                # cannot reach its rate; the latency bounds the queue.
                burst = max(_bits(rate) // 8 // 100, 64 * 1024)
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "50ms")

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]


def _bits(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate={rate!r}: write it as tc does, e.g. '1gbit' or '100mbit'.")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here, or ``None`` when they can (probably)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed (iproute2)"
    return None


@contextlib.contextmanager
def emulated_link() -> Iterator[Link]:
    """Create the namespaces and veth pair; delete them on exit.

    Yields:
        The :class:`Link` (unthrottled until :meth:`Link.set_rate`).

    Raises:
        RuntimeError: they could not be created (the message carries ``ip``'s error).
    """
    tag = f"pob{os.getpid() % 100000}"
    subnet = os.getpid() % 200 + 20
    link = Link((f"{tag}a", f"{tag}b"), (f"{tag}va", f"{tag}vb"), (f"10.77.{subnet}.1", f"10.77.{subnet}.2"))
    created: list[str] = []
    try:
        for ns in link.namespaces:
            _run("ip", "netns", "add", ns)
            created.append(ns)
        _run("ip", "link", "add", link.devices[0], "type", "veth", "peer", "name", link.devices[1])
        for ns, dev, addr in zip(link.namespaces, link.devices, link.addresses):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield link
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"could not create the emulated link: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
    finally:
        for ns in created:  # deleting a namespace deletes its veth end, and the pair with it
            _run("ip", "netns", "del", ns, check=False)
