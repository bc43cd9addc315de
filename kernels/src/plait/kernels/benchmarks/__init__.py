"""plait-kernels' benchmarks (``plait bench kernels``): one module per kernel, gathered by ``suite``."""
