"""plait.lightning: ZeRO for the Lightning Trainer and Fabric, with universal checkpoints.

Importing this package registers the strategy names ``plait_zero1``, ``plait_zero2``,
``plait_zero3`` and (with plait-offload-io) ``plait_zero2_offload``, ``plait_zero3_offload``,
``plait_zero3_offload_nvme`` for both the Trainer and Fabric::

    import lightning as L
    import plait.lightning  # noqa: F401 - registers the names

    trainer = L.Trainer(strategy="plait_zero3", devices=2, precision="bf16-mixed")
    trainer = L.Trainer(strategy=PlaitStrategy(zero=ZeroConfig(stage=2)), devices=2)
"""

from plait.lightning.checkpoint import (
    checkpoint_bytes,
    consolidated_state_dict,
    export_weights,
    is_directory_checkpoint,
)
from plait.lightning.config import NAMES, PRECISIONS, PlaitConfig, register_names
from plait.lightning.fabric import PlaitFabricStrategy
from plait.lightning.onebit_ddp import OptimizerOwnsExchange, fabric_owns_exchange
from plait.lightning.pieces import PieceMissingError, ShardingExtension
from plait.lightning.precision import PlaitFabricPrecision, PlaitPrecision
from plait.lightning.preemption import PreemptionCheckpoint
from plait.lightning.stragglers import StragglerMonitor
from plait.lightning.strategy import PlaitStrategy
from plait.zero_sharding import ZeroConfig


def register_all() -> None:
    """Register the ``plait_*`` names for the Trainer and for Fabric (done once at import)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    register_names(StrategyRegistry, PlaitStrategy)
    register_names(STRATEGY_REGISTRY, PlaitFabricStrategy)


register_all()

__all__ = [
    "NAMES", "PRECISIONS", "OptimizerOwnsExchange", "PieceMissingError", "PlaitConfig", "PlaitFabricPrecision",
    "fabric_owns_exchange",
    "PlaitFabricStrategy", "PlaitPrecision", "PlaitStrategy", "PreemptionCheckpoint", "ShardingExtension",
    "StragglerMonitor", "ZeroConfig", "checkpoint_bytes", "consolidated_state_dict", "export_weights",
    "is_directory_checkpoint", "register_all",
]
