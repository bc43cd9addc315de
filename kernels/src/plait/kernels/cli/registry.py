"""What installed plait distributions contribute, read from their entry points.

Entry-point groups:

* ``plait.commands``: ``name = "module:register"``; ``register(subparsers)`` adds a subcommand.
* ``plait.benchmarks``: ``name = "module:run"``; ``run(quick: bool) -> list[BenchRow]``.
* ``lightning.pytorch.strategies`` / ``vllm.general_plugins`` and any other group a plait
  distribution declares are listed by ``plait report`` as what it registers.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata


@dataclasses.dataclass(frozen=True)
class PlaitDistribution:
    """An installed plait distribution and the entry points it declares."""

    name: str
    version: str
    import_name: str
    entry_points: tuple[metadata.EntryPoint, ...]


def import_name_of(distribution: str) -> str:
    """docs/conventions.md's rule: the first ``-`` becomes ``.``, the rest ``_``.

    ``plait-zero-sharding`` -> ``plait.zero_sharding``.
    """
    head, _, tail = distribution.partition("-")
    return f"{head}.{tail.replace('-', '_')}" if tail else head


def plait_distributions() -> list[PlaitDistribution]:
    """Every installed distribution named ``plait`` or ``plait-*``, sorted by name."""
    found: dict[str, PlaitDistribution] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name != "plait" and not name.startswith("plait-"):
            continue
        found[name] = PlaitDistribution(name=name, version=dist.version, import_name=import_name_of(name),
                                        entry_points=tuple(dist.entry_points))
    return [found[name] for name in sorted(found)]


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """name -> entry point for one group, across every installed distribution."""
    return {ep.name: ep for ep in metadata.entry_points(group=group)}
