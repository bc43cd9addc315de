"""ZeRO stages 1/2/3 for plain PyTorch modules and optimizers.

Example::

    with sharded_init(mesh):
        model = MyTransformer(cfg)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh, lr=3e-4)
    for batch in loader:
        loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from plait.zero_sharding.activation_checkpointing import checkpoint_blocks, decoder_blocks, uncheckpoint_blocks
from plait.zero_sharding.api import gathered_parameters, resolve_group, resolve_groups, sharded_init, zero_shard
from plait.zero_sharding.checkpoint import export_full_weights, iter_full_parameters
from plait.zero_sharding.composition import ShardingExtension, apply_extensions, check_extensions
from plait.zero_sharding.config import ZeroConfig
from plait.zero_sharding.construction import ConstructedParameter
from plait.zero_sharding.extension import (
    DefaultGatherer,
    DefaultReducer,
    GradientReducer,
    LocalPlacement,
    ParamGatherer,
    ShardStorage,
    StatePlacement,
)
from plait.zero_sharding.low_precision import LowPrecisionOptimizer, TensorPrecision
from plait.zero_sharding.memory import model_state_bytes, zero_formula_bytes
from plait.zero_sharding.module import ZeroModule
from plait.zero_sharding.muon import MuonWithAdamW, muon_param_groups
from plait.zero_sharding.optimizer import ZeroOptimizer
from plait.zero_sharding.pretrained import LoadedWeights, load_safetensors
from plait.zero_sharding.profiling import StepBreakdown
from plait.zero_sharding.replicas import ReplicaMismatchError, check_replicas
from plait.zero_sharding.whole_tensor import WholeTensorPlacement, register_whole_tensor

__all__ = [
    "ConstructedParameter", "DefaultGatherer", "DefaultReducer", "GradientReducer", "LocalPlacement",
    "LoadedWeights", "LowPrecisionOptimizer", "MuonWithAdamW", "ParamGatherer",
    "ReplicaMismatchError", "ShardingExtension", "ShardStorage", "StatePlacement", "StepBreakdown",
    "TensorPrecision", "WholeTensorPlacement",
    "ZeroConfig", "ZeroModule", "ZeroOptimizer", "apply_extensions", "check_extensions", "check_replicas",
    "checkpoint_blocks", "decoder_blocks",
    "export_full_weights", "gathered_parameters", "iter_full_parameters", "load_safetensors", "model_state_bytes",
    "muon_param_groups",
    "register_whole_tensor", "resolve_group", "resolve_groups", "sharded_init", "uncheckpoint_blocks",
    "zero_formula_bytes", "zero_shard",
]
