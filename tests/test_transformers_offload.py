"""plait-transformers with plait-offload-io: the HF Trainer on ZeRO-3 with parameters, fp32 masters
and optimizer state on CPU (and ZeRO-2 with the optimizer state on CPU) against the plain DDP
Trainer, 2 gloo processes, a tiny random Llama."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from plait.kernels.testing import run_distributed

pytest.importorskip("plait.offload_io")
pytest.importorskip("plait.transformers")

RTOL_FP32 = 1e-5  # fp32, same data and seed; only the order of the cross-rank sums differs from DDP


def _runs(tmp: str) -> dict[str, Any]:
    from plait.transformers.demo import train

    common = dict(gradient_accumulation_steps=2)
    return {"ddp": train("ddp", f"{tmp}/ddp", **common),
            "zero3_offload": train("plait", f"{tmp}/z3", plait={"zero": {"stage": 3}, "offload": "cpu"}, **common),
            "zero2_offload": train("plait", f"{tmp}/z2", plait={"zero": {"stage": 2}, "offload": "cpu"}, **common)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(_runs, 2, str(tmp_path_factory.mktemp("hf_offload")), timeout=300)[0]


@pytest.mark.parametrize("name", ["zero3_offload", "zero2_offload"])
def test_offloaded_trainer_equals_ddp(runs: dict[str, Any], name: str) -> None:
    ours, ddp = runs[name], runs["ddp"]
    assert ours.placement == "ZeroOffloadPlacement" and ddp.placement is None  # the offload really ran
    assert len(ours.losses) == len(ddp.losses) == 4
    for a, e in zip(ours.losses + ours.grad_norms, ddp.losses + ddp.grad_norms):
        assert math.isclose(a, e, rel_tol=RTOL_FP32), (ours, ddp)


def test_an_extension_placement_contradicts_offload(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "transformers" / "tests"))
    from test_transformers_config import _Extension, _trainer

    from plait.transformers import PlaitConfig
    from plait.zero_sharding import ZeroConfig

    ext = _Extension(supplies={"placement": object()})
    with pytest.raises(ValueError, match="'offload' and .* both supply the ZeRO placement"):
        _trainer(tmp_path, PlaitConfig(zero=ZeroConfig(stage=2), offload="cpu", extensions=(ext,)))
