"""Benchmarks of plait-inference-kernels (``plait bench inference-kernels``)."""
