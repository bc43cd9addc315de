"""Floor 4 of plait-onebit-optim: 1-bit Adam, 1-bit LAMB and 0/1 Adam composed with ZeRO-1/2.

``zero_shard`` calls the optimizers' ``compose_with_zero`` hook, which delegates to
:func:`.compose.compose_with_zero`: it builds the engine-wide reducer (:mod:`.exchange`, or for
0/1 Adam :mod:`.adam01`) and the inner optimizer over the fp32 master shards (:mod:`.onebit_adam`,
:mod:`.onebit_lamb`, :mod:`.adam01`). :mod:`.layout` is the unit layout they share,
:mod:`.settle` and :mod:`.variance_floor` complete per-tensor statistics across the shards.
"""
