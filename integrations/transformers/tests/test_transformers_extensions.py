"""Feature packages compose with the HF Trainer through plait-zero-sharding's composition protocol,
exactly as with Lightning: ``check_extensions`` when the Trainer is built, ``apply_extensions``
right before ``zero_shard``, and the engine's hooks on the extension objects. 2 gloo processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.kernels.testing import run_distributed
from plait.transformers.demo import train

STEPS, GA = 4, 2


class CountingReducer:
    """A ShardingExtension supplying ZeRO's reducer: counts every protocol call and engine hook,
    then reduces as the default reducer does (a no-op for the numbers)."""

    order = 40

    def __init__(self) -> None:
        from plait.zero_sharding import DefaultReducer

        self.inner = DefaultReducer()
        self.calls = {"check": 0, "apply": 0, "zero_kwargs": 0, "bind": 0, "reduce_scatter": 0, "all_reduce": 0,
                      "on_skipped_step": 0}
        self.precisions: list[str] = []
        self.steps: list[int] = []
        self.applied_to: str | None = None
        self.bound_units = 0

    def check(self, settings: Any, precision: str) -> None:
        self.calls["check"] += 1
        self.precisions.append(precision)

    def apply(self, module: Any, mesh: Any) -> Any:
        self.calls["apply"] += 1
        self.applied_to = type(module).__name__  # the plain model: ZeRO has not sharded it yet
        return module

    def zero_kwargs(self) -> dict[str, Any]:
        self.calls["zero_kwargs"] += 1
        return {"reducer": self}

    def bind(self, engine: Any) -> None:
        self.calls["bind"] += 1
        self.bound_units = len(engine.units)

    def on_step(self, step: int) -> None:
        self.steps.append(step)

    def on_skipped_step(self, step: int) -> None:
        self.calls["on_skipped_step"] += 1

    def reduce_scatter(self, full: torch.Tensor, shard_out: torch.Tensor, *, group: Any, key: str) -> Any:
        self.calls["reduce_scatter"] += 1
        return self.inner.reduce_scatter(full, shard_out, group=group, key=key)

    def all_reduce(self, tensor: torch.Tensor, *, group: Any, key: str) -> Any:
        self.calls["all_reduce"] += 1
        return self.inner.all_reduce(tensor, group=group, key=key)


def _spied(ext: CountingReducer, seen: dict[str, Any]) -> tuple[type, Any]:
    """A Trainer subclass and a callback recording when the Trainer meets the extension."""
    import transformers

    from plait.zero_sharding import ZeroModule

    # with_plait puts its mixin above this class: Spy's methods run inside the mixin's.
    class Spy(transformers.Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            seen["checked_at_build"] = ext.calls["check"]
            seen["applied_at_build"] = ext.calls["apply"]

        def create_optimizer(self, model: Any = None) -> Any:
            # The Trainer's optimizer is built after the extensions ran, before ZeRO.
            seen["applied_before_optimizer"] = ext.calls["apply"]
            seen["sharded_before_optimizer"] = isinstance(self.model, ZeroModule)
            return super().create_optimizer(model)

    class Engine(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            seen["sharded"] = isinstance(model, ZeroModule)
            seen["reducer_is_ext"] = model.zero_engine.reducer is ext

    return Spy, Engine()


def _runs(tmp: str) -> dict[str, Any]:
    from plait.transformers import PlaitConfig
    from plait.zero_sharding import ZeroConfig

    out: dict[str, Any] = {}
    for stage in (2, 3):
        common = dict(max_steps=STEPS, gradient_accumulation_steps=GA)
        out[f"plain{stage}"] = train("plait", f"{tmp}/plain{stage}", plait=PlaitConfig(zero=ZeroConfig(stage=stage)),
                                     **common)
        ext, seen = CountingReducer(), {}
        trainer_cls, callback = _spied(ext, seen)
        out[f"ext{stage}"] = train("plait", f"{tmp}/ext{stage}", trainer_cls=trainer_cls, callbacks=(callback,),
                                   plait=PlaitConfig(zero=ZeroConfig(stage=stage), extensions=(ext,)), **common)
        out[f"ext{stage}_calls"] = dict(ext.calls)
        out[f"ext{stage}_info"] = {"precisions": ext.precisions, "steps": ext.steps, "applied_to": ext.applied_to,
                                   "bound_units": ext.bound_units, **seen}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_runs, 2, str(tmp_path_factory.mktemp("hf_ext")), timeout=420)


@pytest.mark.parametrize("stage", [2, 3])
def test_extension_hooks_are_called_as_under_lightning(runs: list[dict[str, Any]], stage: int) -> None:
    for rank in runs:
        calls, info = rank[f"ext{stage}_calls"], rank[f"ext{stage}_info"]
        # check_extensions when the Trainer is built (before any work), again right before sharding.
        assert info["checked_at_build"] == 1 and info["applied_at_build"] == 0
        assert calls["check"] == 2 and info["precisions"] == ["32-true", "32-true"]
        # apply_extensions once, on the unsharded model, and its reducer handed to zero_shard.
        assert calls["apply"] == 1 and info["applied_to"] == "LlamaForCausalLM"
        assert info["applied_before_optimizer"] == 1 and not info["sharded_before_optimizer"]
        assert calls["zero_kwargs"] >= 2  # check_extensions and apply_extensions each read it
        assert info["sharded"] and info["reducer_is_ext"]
        # The engine's hooks: bound once, every gradient reduced through it, told of every step.
        assert calls["bind"] == 1 and info["bound_units"] > 0
        assert calls["reduce_scatter"] > 0
        assert info["steps"] == list(range(1, STEPS + 1))
        assert calls["on_skipped_step"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_a_noop_extension_trains_exactly_as_without_it(runs: list[dict[str, Any]], stage: int) -> None:
    for rank in runs:
        assert len(rank[f"plain{stage}"].losses) == STEPS
        assert rank[f"ext{stage}"].losses == rank[f"plain{stage}"].losses
        assert rank[f"ext{stage}"].grad_norms == rank[f"plain{stage}"].grad_norms
