"""``plait bench zero-sharding``: ZeRO stages 1/2/3 against DDP, FSDP2 and DeepSpeed in the same run.

``paired_setup`` builds each setup (plait, DeepSpeed, FSDP2, DDP) on the same weights and batch;
``paired_worker`` runs one rank: per stage, plait and its peers alternate steps in the same ranks,
then one counted step each for bytes and memory; ``paired_suite.run(quick)`` turns the results
into rows (exact bytes against the formula, memory against the ZeRO formula and FSDP2, time
against DeepSpeed and FSDP2) and appends the ZeRO++ rows of :mod:`plait.zero_sharding.zeropp.bench`.
"""
