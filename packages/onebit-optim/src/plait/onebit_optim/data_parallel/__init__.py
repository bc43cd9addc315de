"""Floor 3 of plait-onebit-optim: the optimizers for a model replicated on every rank.

:class:`~plait.onebit_optim.OnebitAdam` (:mod:`.onebit_adam`), :class:`~plait.onebit_optim.Lamb`
and :class:`~plait.onebit_optim.OnebitLamb` (:mod:`.onebit_lamb`), 0/1 Adam's
:class:`~plait.onebit_optim.ZeroOneAdam` (:mod:`.adam01`), over their shared base
(:mod:`.base`). They apply the rules of floor 1 with the exchange of floor 2.
"""
