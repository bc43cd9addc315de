"""Floor 1 of plait-onebit-optim: the update rules, as functions of tensors.

No communication and no optimizer classes: AdamW's warm-up step and 1-bit Adam's frozen-variance
update (:mod:`.adam`), LAMB's direction and trust ratio (:mod:`.lamb`), 0/1 Adam's update and
resynchronisation (:mod:`.adam01`), the variance floor (:mod:`.variance_floor`) and the freeze
decision (:mod:`.settle`). These modules import only :mod:`plait.onebit_optim.config` below them.
"""
