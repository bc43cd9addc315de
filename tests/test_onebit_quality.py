"""The issue's convergence test for each optimizer under ZeRO: 300 steps of the quality
benchmark's tiny-llama within 2% of ZeRO + AdamW (data-parallel LAMB for 1-bit LAMB).

The whole matrix (W=2 and W=4, ZeRO-1 and ZeRO-2, fp32 and bf16: 36 runs, 16 minutes here) is
``plait bench onebit-optim-quality``, whose committed table has every row within 2%. This test
runs cells of it in every CI run, the benchmark's own code (``benchmarks.quality._train``, the
same settings): 0/1 Adam under ZeRO-2 at W=2 in fp32 and at W=4 in bf16. 0/1 Adam's setting keeps
its variance phase in full precision (see the package README, "Why this setting"): what it checks
is its local-step phase. 1-bit Adam and 1-bit LAMB's 300 ZeRO-2 steps at W=2 against ZeRO-2 AdamW
and data-parallel LAMB run on a transformers Llama of the same shape in ``test_onebit_zero.py``
and ``test_onebit_zero_lamb.py``.
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
    (2, "fp32", ("zero_one_adam",)),
    (4, "bf16", ("zero_one_adam",)),
], ids=["W2-fp32", "W4-bf16"])
def test_three_hundred_steps_end_within_two_percent_of_the_reference(world, dtype, kinds):
    adamw = _final("adamw", world, 2, dtype)
    for kind in kinds:
        ours = _final(kind, world, 2, dtype)
        assert ours <= quality.TARGET * adamw, (kind, world, dtype, ours, adamw)
