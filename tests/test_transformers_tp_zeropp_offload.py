"""The HF Trainer with ``PlaitConfig(tp_size=2)`` plus ZeRO++ or CPU offload (cross-package:
plait-transformers + plait-zero-sharding + plait-offload-io): a tiny random Llama split by its own
``tp_plan`` over tp, plait ZeRO-3 over dp, dp 2 x tp 2 on 4 gloo processes, in one launch.

The Trainer passes ``ZeroConfig.zeropp`` and ``PlaitConfig.offload`` through to ``zero_shard`` as
it does without ``tp_size``; plait-zero-sharding composes them with tensor-parallel parameters
(``tests/test_tp_zeropp_offload.py``). Here, through the Trainer, against the plain tp_size ZeRO-3
run, every run stepping the fused CPU AdamW (``optim="adamw_torch_fused"``, the kernel the
offloaded optimizer uses):

* hpZ (a secondary partition of 1, exact) and offload of the optimizer state to CPU: losses and
  gradient norms bitwise equal;
* the CPU-offload run saves a checkpoint at step 2 (its optimizer state gathered from host memory)
  that a new Trainer resumes from, its step 3 bitwise the uninterrupted one (hpZ changes only how
  parameters are gathered, not what a checkpoint holds);
* qwZ + qgZ + hpZ (quantized weights and gradients): losses within the tolerance table's
  ``zeropp_qgz_losses``;
* the engine the Trainer built holds the ZeRO++ policies and the offload placement asked for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("plait.offload_io")

from plait.kernels.testing import run_distributed
from plait.kernels.tolerances import tolerance

STEPS, SAVE_AT, PER_RANK = 3, 2, 2
HPZ = dict(quantized_weights=False, quantized_gradients=False, hierarchical_partition_size=1)
ALL = dict(hierarchical_partition_size=1)  # qwZ + qgZ + hpZ


def _engine_probe() -> Any:
    """A callback recording the names of the engine's gatherer, reducer and placement classes."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        seen: tuple[str, str, str] | None = None

        def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            engine = model.zero_engine
            self.seen = tuple(type(x).__name__ for x in (engine.gatherer, engine.reducer, engine.placement))

    return Probe()


def _session(tmp: str) -> dict[str, Any]:
    from plait.transformers import PlaitConfig
    from plait.transformers.demo import train
    from plait.zero_sharding import ZeroConfig
    from plait.zero_sharding.zeropp import ZeroPPConfig

    cases = {"plain": PlaitConfig(zero=ZeroConfig(stage=3), tp_size=2),
             "hpz": PlaitConfig(zero=ZeroConfig(stage=3, zeropp=ZeroPPConfig(**HPZ)), tp_size=2),
             "cpu": PlaitConfig(zero=ZeroConfig(stage=3), tp_size=2, offload="cpu"),
             "zeropp": PlaitConfig(zero=ZeroConfig(stage=3, zeropp=ZeroPPConfig(**ALL)), tp_size=2)}
    args = dict(per_device_train_batch_size=PER_RANK, max_steps=STEPS, optim="adamw_torch_fused")
    out: dict[str, Any] = {}
    for name, config in cases.items():
        probe = _engine_probe()
        saves = dict(save_strategy="steps", save_steps=SAVE_AT) if name == "cpu" else {}
        run = train("plait", f"{tmp}/{name}", plait=config, callbacks=(probe,), **args, **saves)
        out[name] = {"losses": run.losses, "grad_norms": run.grad_norms, "engine": probe.seen}
        if saves:
            resumed = train("plait", f"{tmp}/{name}-resumed", plait=config, resume=f"{tmp}/{name}/checkpoint-{SAVE_AT}",
                            **args)
            out[name]["resumed"] = {"losses": resumed.losses, "grad_norms": resumed.grad_norms}
    return out


@pytest.mark.timeout(300)
def test_trainer_tp2_with_zeropp_and_offload_equals_plain_tp2_and_resumes(tmp_path) -> None:
    results = run_distributed(_session, 4, str(tmp_path), timeout=280)
    for out in results:
        plain = out["plain"]
        assert len(plain["losses"]) == STEPS and len(plain["grad_norms"]) == STEPS, plain
        for name in ("hpz", "cpu"):
            run = out[name]
            assert run["losses"] == plain["losses"] and run["grad_norms"] == plain["grad_norms"], (name, run, plain)
        cpu, resumed = out["cpu"], out["cpu"]["resumed"]  # the checkpoint's history, then its own step
        assert resumed["losses"][SAVE_AT:] == cpu["losses"][SAVE_AT:], (resumed, cpu)
        assert resumed["grad_norms"][-1] == cpu["grad_norms"][-1], (resumed, cpu)
        tolerance("zeropp_qgz_losses", torch.float32).assert_close(torch.tensor(out["zeropp"]["losses"]),
                                                                   torch.tensor(plain["losses"]))
        assert out["zeropp"]["losses"] != plain["losses"], "quantized communication changes the losses a little"
        assert plain["engine"] == ("DefaultGatherer", "DefaultReducer", "LocalPlacement"), plain["engine"]
        assert out["hpz"]["engine"] == ("HierarchicalParamGatherer", "DefaultReducer", "LocalPlacement"), out
        assert out["cpu"]["engine"] == ("DefaultGatherer", "DefaultReducer", "ZeroOffloadPlacement"), out
        quantized = ("HierarchicalParamGatherer", "QuantizedGradientReducer", "LocalPlacement")
        assert out["zeropp"]["engine"] == quantized, out["zeropp"]["engine"]
    print({name: results[0][name]["engine"] for name in ("plain", "hpz", "cpu", "zeropp")})
