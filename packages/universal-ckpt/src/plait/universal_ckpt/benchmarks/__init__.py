"""The universal-ckpt benchmark suite (`plait bench universal-ckpt`)."""
