"""ZeroPPConfig and the factory that turns it into the engine's gather and reduce policies."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from plait.kernels.ops.quantize import MAX_BLOCK_SIZE, SUPPORTED_BITS
from plait.zero_sharding.extension import DefaultGatherer, DefaultReducer, GradientReducer, ParamGatherer
from plait.zero_sharding.zeropp.gather import DEFAULT_BLOCK_SIZE, HierarchicalParamGatherer, QuantizedParamGatherer
from plait.zero_sharding.zeropp.reduce import QuantizedGradientReducer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroPPConfig:
    """Which ZeRO++ communication reductions to use (each one can be switched on alone).

    The defaults are ZeRO++'s: int8 weight gathers and int4 gradient reduction; the hierarchical
    partition is off until ``hierarchical_partition_size`` says how many ranks form a node.

    Attributes:
        quantized_weights: qwZ: all-gather parameters as blockwise int codes plus fp32 scales.
        weight_bits: bits per weight code, 8 (ZeRO++) or 4.
        quantized_gradients: qgZ: reduce gradients by a quantized all-to-all.
        gradient_bits: bits per gradient code, 4 (ZeRO++) or 8.
        hierarchical_partition_size: hpZ: ranks per node (consecutive ranks of the sharding
            group); the backward all-gather then stays inside the node, at the cost of a
            secondary shard of ``Psi / size`` per rank. ``None`` disables hpZ. Must divide the
            group size (checked by :func:`make_zeropp_policies`).
        block_size: elements sharing one fp32 scale, a power of two in [2, 65536]; 256 costs
            4/256 = 1.6% extra bytes on int8 and bounds the error by half a 1/127 (1/7 for int4)
            of each block's largest magnitude.
    """

    quantized_weights: bool = True
    weight_bits: int = 8
    quantized_gradients: bool = True
    gradient_bits: int = 4
    hierarchical_partition_size: int | None = None
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
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"ZeroPPConfig.hierarchical_partition_size={size!r} must be None (off) or a positive int: the "
                f"number of ranks per node, e.g. 8."
            )
        block = self.block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block > MAX_BLOCK_SIZE \
                or block & (block - 1):
            raise ValueError(
                f"ZeroPPConfig.block_size={block!r} must be a power of two in [2, {MAX_BLOCK_SIZE}]; use e.g. 256."
            )

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
        backward = 0.0 if self.hierarchical_partition_size == 1 else forward
        return {"forward": forward, "backward": backward, "reduce": reduce, "total": forward + backward + reduce}


def make_zeropp_policies(config: ZeroPPConfig, group: Any | None = None) -> tuple[ParamGatherer, GradientReducer]:
    """Build the parameter gatherer and gradient reducer that implement ``config``.

    Call it on every rank of ``group`` at the same point: with hpZ it creates node subgroups
    (``torch.distributed.new_group`` is collective).

    Args:
        config: what to switch on.
        group: the process group the engine shards over (``None``: the world).

    Returns:
        ``(gatherer, reducer)`` for the ZeRO engine; parts that are off use the engine's exact
        defaults (:class:`DefaultGatherer`, :class:`DefaultReducer`).

    Raises:
        TypeError: ``config`` is not a :class:`ZeroPPConfig`.
        ValueError: hpZ is on and ``hierarchical_partition_size`` does not divide the group size,
            or torch.distributed is not initialised.
    """
    if not isinstance(config, ZeroPPConfig):
        raise TypeError(f"make_zeropp_policies: config must be a ZeroPPConfig, got {type(config).__name__}.")
    gatherer: Any = (
        QuantizedParamGatherer(bits=config.weight_bits, block_size=config.block_size)
        if config.quantized_weights else DefaultGatherer()
    )
    size = config.hierarchical_partition_size
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
    reducer: Any = (
        QuantizedGradientReducer(bits=config.gradient_bits, block_size=config.block_size)
        if config.quantized_gradients else DefaultReducer()
    )
    return gatherer, reducer
