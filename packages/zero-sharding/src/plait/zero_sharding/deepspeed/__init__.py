"""DeepSpeed compatibility: DeepSpeed's config file and learning-rate schedules on plait's ZeRO.

* :func:`~plait.zero_sharding.deepspeed.config.translate` reads a ``ds_config`` dict or JSON
  file into plait settings; every key is mapped, accepted (with the reason it changes nothing)
  or refused before any work (see :data:`~plait.zero_sharding.deepspeed.config.KEYS`).
* :mod:`~plait.zero_sharding.deepspeed.schedules`: ``WarmupLR``, ``WarmupDecayLR``,
  ``WarmupCosineLR`` and ``OneCycle`` as torch LR schedulers with DeepSpeed's formulas.
"""
