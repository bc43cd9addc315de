"""A compiled model under ``plait_zero3``: the decoder blocks compiled in ``configure_model`` (per
block, torchtitan's way), then sharded by the strategy. W=2 gloo, tiny Llama: dynamo compiles the
blocks, and with the ``aot_eager`` backend the losses are bitwise those of the uncompiled model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from plait.kernels.testing import run_distributed
from plait.lightning.demo import TinyLlamaModule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the Trainer helpers of test_lightning_distributed


class CompiledBlocks(TinyLlamaModule):
    """The demo module with each decoder block compiled where the model is built."""

    def configure_model(self) -> None:
        """Build the model, then compile every block in place (``Module.compile``)."""
        super().configure_model()
        for block in self.model.layers:
            block.compile(backend="aot_eager")


def session() -> dict[str, Any]:
    """The eager and the compiled module under plait_zero3 (module level: imported in each rank)."""
    import torch._dynamo.utils as dynamo_utils
    from test_lightning_distributed import STEPS, _fit, _quiet

    _quiet()
    eager, _ = _fit("plait_zero3", devices=2, steps=STEPS)
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    compiled, _ = _fit("plait_zero3", devices=2, steps=STEPS, module_cls=CompiledBlocks)
    return {"eager": eager, "compiled": compiled, "graphs": dynamo_utils.counters["stats"]["unique_graphs"] - before}


def test_blocks_compiled_in_configure_model_train_under_plait_zero3_as_eager() -> None:
    for result in run_distributed(session, 2, timeout=300):
        assert result["graphs"] > 0, "nothing was compiled"
        assert sorted(result["eager"]) == [0, 1, 2, 3]
        assert result["compiled"] == result["eager"]  # aot_eager: the same kernels, bit for bit
