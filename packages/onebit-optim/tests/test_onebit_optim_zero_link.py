"""The ZeRO-2 slow-link rows against DDP + AdamW (:mod:`plait.onebit_optim.benchmarks.zero_link`),
from hand-made worker results: block-by-block ratios, the p90 judging the target, a variant that
could not run. No launch, no network namespaces."""

from __future__ import annotations

import math

from plait.onebit_optim.benchmarks.worker import ZERO_VARIANTS, onebit_optimizer
from plait.onebit_optim.benchmarks.zero_link import VARIANTS, against_ddp


def _result(seconds: list[float]) -> dict:
    blocks = [{"seconds": 9.0, "timed": False, "losses": [1.0] * 4, "bytes": 0}]
    return {"blocks": blocks + [{"seconds": s, "timed": True, "losses": [1.0] * 4, "bytes": 0} for s in seconds]}


def test_ratios_are_block_by_block_and_the_target_is_judged_by_the_p90() -> None:
    results = {"ddp_adamw": _result([4.0, 4.0, 8.0, 4.0, 4.0]),
               "zero2_adamw": _result([4.0, 4.0, 8.0, 4.0, 4.0]),
               "zero2_onebit_adam": _result([2.0, 2.0, 4.0, 2.0, 3.0]),  # 0.5 x4, 0.75
               "zero2_onebit_adam_update": _result([1.0, 1.0, 2.0, 1.0, 1.0])}  # 0.25 in every block
    rows = {row.benchmark.split(" ")[0]: row for row in against_ddp(results, "1gbit")}
    assert set(rows) == set(VARIANTS[1:])
    assert rows["zero2_adamw"].ratio == 1.0 and rows["zero2_adamw"].passed is None
    assert rows["zero2_onebit_adam"].ratio == 0.5 and rows["zero2_onebit_adam"].passed is False  # p90 0.75
    assert rows["zero2_onebit_adam_update"].ratio == 0.25 and rows["zero2_onebit_adam_update"].passed is True
    assert "0.250/0.250/0.250 over 5 blocks" in rows["zero2_onebit_adam_update"].note


def test_a_variant_that_could_not_run_says_why() -> None:
    results = {"ddp_adamw": _result([4.0, 4.0]), "zero2_adamw": _result([4.0, 4.0]),
               "zero2_onebit_adam": {"blocks": [], "error": "ValueError: no"},
               "zero2_onebit_adam_update": _result([1.0, 1.0])}
    row = next(r for r in against_ddp(results, "1gbit") if r.benchmark.startswith("zero2_onebit_adam "))
    assert math.isnan(row.ours) and "could not run: ValueError: no" in row.note


def test_the_update_variant_is_1bit_adam_without_the_gather_in_both_stages() -> None:
    assert {"zero1_onebit_adam_update", "zero2_onebit_adam_update"} <= set(ZERO_VARIANTS)
    cls, config, extra = onebit_optimizer("onebit_adam_update", {"block": 4})
    assert cls.__name__ == "OnebitAdam" and config.zero_param_sync == "update" and config.freeze_step == 2
    assert extra == {}
