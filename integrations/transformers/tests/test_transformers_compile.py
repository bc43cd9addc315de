"""``TrainingArguments(torch_compile=True)`` under plait's Trainer backend compiles the sharded model.

The Trainer compiles through Accelerate's ``prepare_model``, which the plait route does not take; the
backend honours the flag itself (``compile_sharded``). Checked at W=2 (2 gloo ranks, tiny Llama,
ZeRO-3): dynamo compiled graphs (the flag is not silently ignored), and with the ``aot_eager``
backend the losses are bitwise those of the same run without compilation.
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.kernels.testing import run_distributed

pytest.importorskip("transformers")


def _session(tmp: str) -> dict[str, Any]:
    import torch._dynamo.utils as dynamo_utils

    from plait.transformers.demo import quiet, train

    quiet()
    eager = train("plait", f"{tmp}/eager", plait={"zero": {"stage": 3}}).losses
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    compiled = train("plait", f"{tmp}/compiled", plait={"zero": {"stage": 3}}, torch_compile=True,
                     torch_compile_backend="aot_eager").losses
    return {"eager": eager, "compiled": compiled, "graphs": dynamo_utils.counters["stats"]["unique_graphs"] - before}


@pytest.mark.timeout(300)
def test_torch_compile_flag_compiles_the_sharded_model_with_eager_losses(tmp_path) -> None:
    for result in run_distributed(_session, 2, str(tmp_path), timeout=240):
        assert result["graphs"] > 0, "torch_compile=True compiled nothing"
        assert len(result["eager"]) == 4
        assert result["compiled"] == result["eager"]  # aot_eager: the same kernels, bit for bit
