"""ZeroPPConfig and the factory that turns it into the engine's gather and reduce policies."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from plait.kernels.ops.quantize import MAX_BLOCK_SIZE, SUPPORTED_BITS
from plait.zero_sharding.extension import DefaultGatherer, DefaultReducer, GradientReducer, ParamGatherer
from plait.zero_sharding.zeropp.exact import HierarchicalReducer
from plait.zero_sharding.zeropp.gather import DEFAULT_BLOCK_SIZE, HierarchicalParamGatherer, QuantizedParamGatherer
from plait.zero_sharding.zeropp.nodes import NodeLayout, detect_layout, given_layout
from plait.zero_sharding.zeropp.reduce import QuantizedGradientReducer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroPPConfig:
    """Which ZeRO++ communication reductions to use (each one can be switched on alone).

    Set it as ``ZeroConfig(zeropp=ZeroPPConfig(...))`` (or ``zeropp=True`` for these defaults):
    plain :func:`~plait.zero_sharding.zero_shard`, the Lightning strategies, Fabric and the HF
    Trainer backend all read it there. The defaults are ZeRO++'s: int8 weight gathers, int4
    gradient reduction, and the hierarchical partition sized to the node. A DeepSpeed config maps
    one to one (:meth:`from_deepspeed`): ``zero_quantized_weights`` -> ``quantized_weights``,
    ``zero_quantized_gradients`` -> ``quantized_gradients``, ``zero_hpz_partition_size`` ->
    ``hierarchical_partition_size`` (DeepSpeed's 1, its "off", becomes ``None``).

    Attributes:
        quantized_weights: qwZ: all-gather parameters as blockwise int codes plus fp32 scales.
        weight_bits: bits per weight code, 8 (ZeRO++) or 4.
        quantized_gradients: qgZ: reduce gradients by a quantized all-to-all; across several
            nodes in two hops (inside the node, then the node sums across nodes), so the slow
            link carries ``1 / ranks_per_node`` of the one-hop bytes. With qgZ off, ZeRO++ still
            reduces exact gradients in two hops across nodes
            (:class:`~plait.zero_sharding.zeropp.exact.HierarchicalReducer`).
        gradient_bits: bits per gradient code, 4 (ZeRO++) or 8.
        hierarchical_partition_size: hpZ: ranks holding one secondary copy of each parameter
            (consecutive ranks of the sharding group); the backward all-gather then stays among
            them, at the cost of a secondary shard of ``Psi / size`` per rank. ``"auto"``
            (default): the ranks per node (see ``ranks_per_node``); on a single node that is
            the whole group, where hpZ would save nothing, so it stays off. An int is used as
            given (1: every rank keeps the whole parameter, backward sends nothing);
            ``None`` disables hpZ. Must divide the group size.
        ranks_per_node: ranks of the sharding group per node. ``"auto"`` (default): read from
            the launcher (torchrun's ``GROUP_RANK``, Lightning's ``NODE_RANK``, SLURM's
            ``SLURM_NODEID``, else the host name; see :mod:`plait.zero_sharding.zeropp.nodes`),
            checking that each node's ranks are consecutive in the group. An int is trusted
            (e.g. to emulate nodes on one machine).
        block_size: elements sharing one fp32 scale, a power of two in [2, 65536]; 256 costs
            4/256 = 1.6% extra bytes on int8 and bounds the error by half a 1/127 (1/7 for int4)
            of each block's largest magnitude.
    """

    quantized_weights: bool = True
    weight_bits: int = 8
    quantized_gradients: bool = True
    gradient_bits: int = 4
    hierarchical_partition_size: int | str | None = "auto"
    ranks_per_node: int | str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name in ("quantized_weights", "quantized_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ZeroPPConfig.{name}={getattr(self, name)!r} must be True or False.")
        for name, usual in (("weight_bits", 8), ("gradient_bits", 4)):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in SUPPORTED_BITS:
                raise ValueError(
                    f"ZeroPPConfig.{name}={value!r} is not supported; use 8 or 4 ({usual} is ZeRO++'s choice)."
                )
        size = self.hierarchical_partition_size
        if size != "auto" and size is not None and not _positive_int(size):
            raise ValueError(
                f"ZeroPPConfig.hierarchical_partition_size={size!r} must be 'auto' (the ranks per node), None (off) "
                f"or a positive int: the number of ranks per node, e.g. 8."
            )
        if self.ranks_per_node != "auto" and not _positive_int(self.ranks_per_node):
            raise ValueError(
                f"ZeroPPConfig.ranks_per_node={self.ranks_per_node!r} must be 'auto' (from the launcher) or a "
                f"positive int, e.g. 8."
            )
        block = self.block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block > MAX_BLOCK_SIZE \
                or block & (block - 1):
            raise ValueError(
                f"ZeroPPConfig.block_size={block!r} must be a power of two in [2, {MAX_BLOCK_SIZE}]; use e.g. 256."
            )

    @property
    def partitions_weights(self) -> bool:
        """Whether a part that only stage 3 has (qwZ or hpZ, both on the parameter gather) is on."""
        return self.quantized_weights or self.hierarchical_partition_size is not None

    @classmethod
    def from_deepspeed(cls, zero_optimization: dict[str, Any]) -> ZeroPPConfig | None:
        """The config matching a DeepSpeed ``zero_optimization`` section, or ``None`` if ZeRO++ is off there.

        Reads ``zero_quantized_weights``, ``zero_quantized_gradients`` and
        ``zero_hpz_partition_size`` (DeepSpeed's defaults: off, off, 1 = off); everything else in
        the section is ignored here.
        """
        if not isinstance(zero_optimization, dict):
            raise ValueError(f"ZeroPPConfig.from_deepspeed: expected the zero_optimization dict, got "
                             f"{type(zero_optimization).__name__}.")
        weights = bool(zero_optimization.get("zero_quantized_weights", False))
        gradients = bool(zero_optimization.get("zero_quantized_gradients", False))
        hpz = zero_optimization.get("zero_hpz_partition_size", 1)
        if not _positive_int(hpz):
            raise ValueError(f"zero_optimization.zero_hpz_partition_size={hpz!r} must be a positive int "
                             "(1 disables hpZ, as in DeepSpeed).")
        if not (weights or gradients or hpz > 1):
            return None
        return cls(quantized_weights=weights, quantized_gradients=gradients,
                   hierarchical_partition_size=hpz if hpz > 1 else None)

    def bytes_per_element(self, itemsize: int) -> dict[str, float]:
        """Logical bytes per parameter element of one stage-3 step, by collective, for this config.

        Args:
            itemsize: bytes of the compute dtype (4 for fp32) used where a part is not quantized.

        Returns:
            ``{"forward": ..., "backward": ..., "reduce": ..., "total": ...}`` (bytes per element,
            counting scales; the backward gather reuses the forward's format under hpZ).
        """
        scale = 4 / self.block_size
        forward = (self.weight_bits / 8 + scale) if self.quantized_weights else itemsize
        reduce = (self.gradient_bits / 8 + scale) if self.quantized_gradients else itemsize
        backward = 0.0 if self.hierarchical_partition_size == 1 else forward  # "auto" is > 1 where it is on
        return {"forward": forward, "backward": backward, "reduce": reduce, "total": forward + backward + reduce}


def make_zeropp_policies(config: ZeroPPConfig, group: Any | None = None) -> tuple[ParamGatherer, GradientReducer]:
    """Build the parameter gatherer and gradient reducer that implement ``config``.

    Call it on every rank of ``group`` at the same point: it may gather the node layout and
    create node subgroups (both collective). ``zero_shard`` calls it for ``ZeroConfig.zeropp``.

    Args:
        config: what to switch on.
        group: the process group the engine shards over (``None``: the world).

    Returns:
        ``(gatherer, reducer)`` for the ZeRO engine; parts that are off use the engine's exact
        defaults (:class:`DefaultGatherer`, :class:`DefaultReducer`).

    Raises:
        TypeError: ``config`` is not a :class:`ZeroPPConfig`.
        ValueError: hpZ or ``ranks_per_node`` does not divide the group size, an explicit hpZ
            size without torch.distributed, or a launcher layout hpZ cannot use (see
            :func:`~plait.zero_sharding.zeropp.nodes.detect_layout`).
    """
    if not isinstance(config, ZeroPPConfig):
        raise TypeError(f"make_zeropp_policies: config must be a ZeroPPConfig, got {type(config).__name__}.")
    layout = resolve_layout(config, group)
    gatherer: Any = (
        QuantizedParamGatherer(bits=config.weight_bits, block_size=config.block_size)
        if config.quantized_weights else DefaultGatherer()
    )
    size = hpz_partition_size(config, layout)
    if size is not None:
        if not dist.is_initialized():
            raise ValueError(
                "ZeroPPConfig.hierarchical_partition_size is set but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group before make_zeropp_policies."
            )
        world = dist.get_world_size(group)
        if world % size:
            raise ValueError(
                f"ZeroPPConfig.hierarchical_partition_size={size} does not divide the sharding group size {world}; "
                f"use a divisor of {world} (the number of ranks per node)."
            )
        gatherer = HierarchicalParamGatherer(partition_size=size, inner=gatherer, group=group)
    # Two hops only where the group really spans nodes of more than one rank each.
    node_size = layout.ranks_per_node if layout is not None and layout.multi_node else None
    reducer: Any = DefaultReducer()
    if config.quantized_gradients:
        options = {"node_size": node_size, "group": group} if node_size is not None else {}
        reducer = QuantizedGradientReducer(bits=config.gradient_bits, block_size=config.block_size, **options)
    elif node_size is not None:  # multi_node: more than one node of more than one rank
        # Exact gradients across nodes: reduce inside the node first (gloo's one-hop reduce-scatter
        # sends 3x the bucket across two nodes, this sends 1x; plait.zero_sharding.zeropp.exact).
        reducer = HierarchicalReducer(node_size=node_size, group=group)
    return gatherer, reducer


def resolve_layout(config: ZeroPPConfig, group: Any | None = None) -> NodeLayout | None:
    """The node layout ``config`` implies for ``group``: given, detected, or ``None`` without torch.distributed.

    Detection (``ranks_per_node="auto"``) is a collective over ``group`` and runs only when a
    part that depends on nodes is on (qgZ, or hpZ).
    """
    if not dist.is_initialized():
        return None
    if config.ranks_per_node != "auto":
        return given_layout(config.ranks_per_node, group)  # type: ignore[arg-type]
    if not (config.quantized_gradients or config.hierarchical_partition_size is not None):
        return None
    return detect_layout(group)


def hpz_partition_size(config: ZeroPPConfig, layout: NodeLayout | None) -> int | None:
    """The hpZ partition ``config`` asks for under ``layout``; ``None`` when hpZ is off or would save nothing."""
    size = config.hierarchical_partition_size
    if size != "auto":
        return size  # type: ignore[return-value]
    if layout is None or layout.nodes == 1:
        return None  # one node: a node-sized secondary copy is the whole group's gather again
    return layout.ranks_per_node

def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
