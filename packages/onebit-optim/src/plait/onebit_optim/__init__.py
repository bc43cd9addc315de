"""1-bit Adam, 1-bit LAMB and 0/1 Adam: optimizers that exchange momentum in 1 bit with error feedback.

For models replicated on every rank of a data-parallel group (the optimizer owns the exchange;
do not wrap the model in DDP). Communication goes through :mod:`plait.kernels.collectives`
(``compressed_allreduce``), so a ``ByteLedger`` counts it.

The package is laid out in floors; a module imports only from its own floor or the ones below
(``tests/test_onebit_optim_layout.py`` checks it):

0. :mod:`~plait.onebit_optim.config`: the frozen settings;
1. :mod:`~plait.onebit_optim.rules`: the update rules, as functions of tensors;
2. :mod:`~plait.onebit_optim.exchange`: the compressed exchange and the cross-rank gradient control;
3. :mod:`~plait.onebit_optim.data_parallel`: the optimizers for a replicated model;
4. :mod:`~plait.onebit_optim.under_zero`: the same optimizers composed with ZeRO-1/2;
5. this module, :mod:`~plait.onebit_optim.deepspeed_keys` and the benchmarks.
"""

from plait.onebit_optim.config import (
    LossScaling,
    OnebitAdamConfig,
    OnebitLambConfig,
    SettleConfig,
    ZeroOneAdamConfig,
    config_from_dict,
)
from plait.onebit_optim.data_parallel.adam01 import ZeroOneAdam
from plait.onebit_optim.data_parallel.base import CompressedOptimizer, set_zero_composition
from plait.onebit_optim.data_parallel.onebit_adam import OnebitAdam
from plait.onebit_optim.data_parallel.onebit_lamb import Lamb, OnebitLamb
from plait.onebit_optim.under_zero.compose import compose_with_zero

# The optimizers' compose_with_zero hook (zero_shard calls it by name) delegates to floor 4.
set_zero_composition(compose_with_zero)

__all__ = [
    "CompressedOptimizer", "Lamb", "LossScaling", "OnebitAdam", "OnebitAdamConfig", "OnebitLamb", "OnebitLambConfig",
    "SettleConfig", "ZeroOneAdam", "ZeroOneAdamConfig", "config_from_dict",
]
