"""``plait bench transformers``: the HF Trainer on plait ZeRO-3 against the DDP Trainer and the
Trainer's own DeepSpeed ZeRO-3 route (see :mod:`plait.transformers.benchmarks.suite`)."""
