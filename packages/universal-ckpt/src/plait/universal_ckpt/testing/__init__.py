"""Test and benchmark tools: a small ZeRO-like sharded producer and training helpers."""

from plait.universal_ckpt.testing.toy_zero import ToyZero, ToyZeroConfig, small_model, train_steps

__all__ = ["ToyZero", "ToyZeroConfig", "small_model", "train_steps"]
