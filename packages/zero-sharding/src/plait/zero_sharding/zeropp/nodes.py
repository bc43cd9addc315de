"""Which ranks of a sharding group share a node: what hpZ and the two-hop qgZ are sized by.

ZeRO++ only pays off when some links are slower than others, and the launcher already knows
which ranks share a machine. Rather than asking the user to repeat it, every rank names its node
from what the launcher set, in this order:

- ``GROUP_RANK``: torchrun's index of this rank's agent (one agent per node);
- ``NODE_RANK``: Lightning's launcher and many multi-node scripts;
- ``SLURM_NODEID``: a job started by ``srun``;
- otherwise the host name (every rank of a single-machine job shares it).

The ranks' node names are gathered over the group (one small collective), and the layout is
accepted only when every node has the same number of ranks and each node's ranks are
consecutive in the group: ZeRO++'s subgroups are cut as runs of consecutive group ranks, so any
other placement would put a "node" group across the slow link. The error then says which ranks
are where and what to pass instead.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from plait.kernels import collectives

# Launcher variables naming this process's node, most specific first (see the module docstring).
NODE_VARIABLES = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """How the sharding group's ranks fall into nodes.

    Attributes:
        ranks_per_node: ranks of the group on each node.
        nodes: number of nodes the group spans.
        source: where the layout came from (``"GROUP_RANK"``, ``"hostname"``, ``"given"``...),
            named in messages.
    """

    ranks_per_node: int
    nodes: int
    source: str

    @property
    def multi_node(self) -> bool:
        """Whether the group spans more than one node with more than one rank each."""
        return self.nodes > 1 and self.ranks_per_node > 1


def node_name(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """This process's node, as ``(name, source)``: the first launcher variable set, else the host name."""
    environ = os.environ if environ is None else environ
    for variable in NODE_VARIABLES:
        value = environ.get(variable, "").strip()
        if value:
            return f"{variable}={value}", variable
    return f"host={socket.gethostname()}", "hostname"


def detect_layout(group: Any = None, *, environ: Mapping[str, str] | None = None) -> NodeLayout:
    """The node layout of ``group`` from the launcher's variables (collective over ``group``).

    Args:
        group: the sharding group (``None``: the world). Every rank of it must call this.
        environ: the variables to read (default ``os.environ``).

    Returns:
        The layout (one node of ``world`` ranks when no launcher says otherwise).

    Raises:
        ValueError: nodes hold different numbers of ranks, or a node's ranks are not consecutive
            in the group; the message lists each node's ranks and says what to pass.
    """
    world = dist.get_world_size(group)
    mine = node_name(environ)
    names: list[Any] = [None] * world
    dist.all_gather_object(names, mine, group=group)
    return layout_from_names([name for name, _ in names], names[0][1])


def layout_from_names(names: list[str], source: str) -> NodeLayout:
    """The layout of a group whose rank ``r`` runs on node ``names[r]`` (see :func:`detect_layout`).

    Raises:
        ValueError: unequal or non-consecutive nodes, naming the ranks.
    """
    members: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        members.setdefault(name, []).append(rank)
    sizes = {len(ranks) for ranks in members.values()}
    described = "; ".join(f"{name}: ranks {ranks}" for name, ranks in members.items())
    if len(sizes) != 1:
        raise ValueError(
            f"ZeRO++ node layout: the nodes hold different numbers of ranks of the sharding group ({described}, "
            f"read from {source}); hpZ and the two-hop qgZ need equal nodes. Launch the same number of ranks per "
            f"node, or set ZeroPPConfig(ranks_per_node=N, hierarchical_partition_size=N) explicitly.")
    size = sizes.pop()
    for ranks in members.values():
        if ranks != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size:
            raise ValueError(
                f"ZeRO++ node layout: a node's ranks are not consecutive in the sharding group ({described}, read "
                f"from {source}); ZeRO++ cuts its node groups as runs of {size} consecutive ranks. Number the ranks "
                f"node by node (torchrun and Lightning do), or set ZeroPPConfig(ranks_per_node=N) explicitly.")
    return NodeLayout(ranks_per_node=size, nodes=len(members), source=source)


def given_layout(ranks_per_node: int, group: Any = None) -> NodeLayout:
    """The layout of an explicit ``ranks_per_node`` (no detection, no collective).

    Raises:
        ValueError: ``ranks_per_node`` does not divide the group size.
    """
    world = dist.get_world_size(group)
    if world % ranks_per_node:
        raise ValueError(
            f"ZeroPPConfig.ranks_per_node={ranks_per_node} does not divide the sharding group size {world}; use a "
            f"divisor of {world}, or 'auto' to take it from the launcher.")
    return NodeLayout(ranks_per_node=ranks_per_node, nodes=world // ranks_per_node, source="given")


def node_subgroups(group: Any, node_size: int) -> tuple[list[int], Any, Any]:
    """Create the two groups of a two-hop collective over ``group`` (collective: every rank of it calls this).

    Args:
        group: the sharding group (``None``: the world); its size must be a multiple of ``node_size``.
        node_size: ranks per node, consecutive in the group.

    Returns:
        ``(ranks, intra, inter)``: the group's global ranks, this rank's node group, and the group of
        the ranks sharing this rank's local index (one per node, in node order).
    """
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    node, local = divmod(dist.get_rank(group), node_size)
    timeout = collectives.group_timeout()
    intra = inter = None
    # Every rank creates every group, in the same order: new_group is collective.
    for n in range(world // node_size):
        created = dist.new_group(ranks[n * node_size:(n + 1) * node_size], timeout=timeout)
        if n == node:
            intra = created
    for lr in range(node_size):
        created = dist.new_group(ranks[lr::node_size], timeout=timeout)
        if lr == local:
            inter = created
    return ranks, intra, inter


def is_group(group: Any, own: Any, own_ranks: list[int] | None) -> bool:
    """Whether ``group`` is ``own`` (the group a two-hop collective was built for), by identity or by ranks."""
    if group is own:
        return True
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    return ranks == own_ranks
