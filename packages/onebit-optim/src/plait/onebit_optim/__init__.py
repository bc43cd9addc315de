"""1-bit Adam, 1-bit LAMB and 0/1 Adam: optimizers that exchange momentum in 1 bit with error feedback.

For models replicated on every rank of a data-parallel group (the optimizer owns the exchange;
do not wrap the model in DDP). Communication goes through :mod:`plait.kernels.collectives`
(``compressed_allreduce``), so a ``ByteLedger`` counts it.
"""

from plait.onebit_optim.adam import OnebitAdam
from plait.onebit_optim.base import CompressedOptimizer
from plait.onebit_optim.config import OnebitAdamConfig, OnebitLambConfig, ZeroOneAdamConfig, config_from_dict
from plait.onebit_optim.grad_control import LossScaling
from plait.onebit_optim.lamb import Lamb, OnebitLamb
from plait.onebit_optim.settle import SettleConfig
from plait.onebit_optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "CompressedOptimizer", "Lamb", "LossScaling", "OnebitAdam", "OnebitAdamConfig", "OnebitLamb", "OnebitLambConfig",
    "SettleConfig", "ZeroOneAdam", "ZeroOneAdamConfig", "config_from_dict",
]
