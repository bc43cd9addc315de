"""Floor 2 of plait-onebit-optim: what crosses the network.

:mod:`.compressed` holds the warm-up's DDP-style gradient average and the 1-bit momentum exchange
(compression, worker and server error feedback, through
:func:`plait.kernels.collectives.compressed_allreduce`); :mod:`.grad_control` the clipping and
loss-scaling decisions every rank must take together. Imports only :mod:`plait.onebit_optim.config`
and :mod:`plait.onebit_optim.rules` below it.
"""
