"""The issue's convergence test for each optimizer under ZeRO: 300 steps of the quality
benchmark's tiny-llama within 2% of ZeRO + AdamW (data-parallel LAMB for 1-bit LAMB).

The whole matrix (W=2 and W=4, ZeRO-1 and ZeRO-2, fp32 and bf16: 36 runs, 16 minutes here) is
``plait bench onebit-optim-quality``, whose committed table has every row within 2%. This test
runs one cell of it in every CI run, the benchmark's own code (``benchmarks.quality._train``,
the same settings): ZeRO-2, W=2, fp32 for the three optimizers, and 0/1 Adam also at W=4 in bf16.
0/1 Adam's setting keeps its variance phase in full precision (see the package README, "Why this
setting"): what it checks is its local-step phase.
"""

from __future__ import annotations

import pytest

pytest.importorskip("plait.zero_sharding")

from plait.kernels.testing import run_distributed
from plait.onebit_optim.benchmarks import quality


def _final(kind: str, world: int, stage: int, dtype: str) -> float:
    losses = run_distributed(quality._train, world, kind, stage, dtype, quality.STEPS, timeout=400)[0]
    assert len(losses) == quality.STEPS
    final = quality._final(losses)
    assert final < 0.5 * losses[0], (kind, losses[0], final)  # it trained (from ln 259 = 5.6 to ~1.8)
    return final


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("world", "dtype", "kinds"), [
    (2, "fp32", ("onebit_adam", "zero_one_adam", "onebit_lamb")),
    (4, "bf16", ("zero_one_adam",)),
], ids=["W2-fp32", "W4-bf16"])
def test_three_hundred_steps_end_within_two_percent_of_the_reference(world, dtype, kinds):
    adamw = _final("adamw", world, 2, dtype)
    for kind in kinds:
        reference = _final("lamb", world, 0, "fp32") if kind == "onebit_lamb" else adamw
        ours = _final(kind, world, 2, dtype)
        assert ours <= quality.TARGET * reference, (kind, world, dtype, ours, reference)
