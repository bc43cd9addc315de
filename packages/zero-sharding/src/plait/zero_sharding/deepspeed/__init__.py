"""DeepSpeed compatibility: DeepSpeed's config, its ``initialize`` and its schedules on plait's ZeRO.

Use it as ``import plait.zero_sharding.deepspeed as deepspeed`` in a DeepSpeed script, or run the
script unedited with ``python -m plait.zero_sharding.deepspeed train.py ARGS`` (also under
``torchrun -m``), which makes ``import deepspeed`` resolve to this module for that run.

* :func:`~plait.zero_sharding.deepspeed.config.translate` reads a ``ds_config`` dict or JSON
  file into plait settings; every key is mapped, accepted (with the reason it changes nothing)
  or refused before any work (see :data:`~plait.zero_sharding.deepspeed.config.KEYS`).
* :mod:`~plait.zero_sharding.deepspeed.schedules`: ``WarmupLR``, ``WarmupDecayLR``,
  ``WarmupCosineLR`` and ``OneCycle`` as torch LR schedulers with DeepSpeed's formulas.
"""

from plait.zero_sharding.deepspeed import zero
from plait.zero_sharding.deepspeed.api import add_config_arguments, init_distributed, initialize
from plait.zero_sharding.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize", "zero"]
