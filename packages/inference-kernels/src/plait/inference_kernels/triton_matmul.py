"""The Triton matrix-multiply step of the inference kernels: plait-kernels' shared ``mma``
(:mod:`plait.kernels.triton_matmul`, also used by the grouped MoE GEMMs), re-exported here for
the paged-attention kernel."""

from plait.kernels.triton_matmul import mma

__all__ = ["mma"]
