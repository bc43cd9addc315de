"""Bad input is refused before any process starts: missing pieces, precisions, contradictions.

Nothing here starts a process group: every error must come from the Trainer/Fabric constructor
or from the check the strategy runs right before its launcher would start processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import plait.lightning
from plait.lightning import PieceMissingError, PlaitConfig, PlaitFabricStrategy, PlaitStrategy, ZeroConfig, pieces
from plait.lightning.demo import TEST_MODEL, TinyLlamaModule

L = pytest.importorskip("lightning")


def _trainer(**kwargs: object) -> object:
    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, max_steps=1)
    base.update(kwargs)
    return L.Trainer(**base)


def test_names_are_registered_for_trainer_and_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for name in plait.lightning.NAMES:
        assert StrategyRegistry[name]["strategy"] is PlaitStrategy
        assert STRATEGY_REGISTRY[name]["strategy"] is PlaitFabricStrategy
    trainer = _trainer(strategy="plait_zero2", devices=2)
    assert isinstance(trainer.strategy, PlaitStrategy) and trainer.strategy.plait_config.zero.stage == 2
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="plait_zero1")
    assert isinstance(fabric.strategy, PlaitFabricStrategy) and fabric.strategy.plait_config.zero.stage == 1


@pytest.mark.parametrize("name", ["plait_zero2_offload", "plait_zero3_offload", "plait_zero3_offload_nvme"])
def test_offload_names_without_offload_io_give_the_pip_line(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "offload_available", lambda: False)
    with pytest.raises(PieceMissingError, match="pip install plait-offload-io"):
        _trainer(strategy=name, devices=2)
    with pytest.raises(PieceMissingError, match="pip install plait-offload-io"):
        L.Fabric(accelerator="cpu", devices=2, strategy=name)


def test_offload_names_with_an_offload_io_lacking_a_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.ModuleType("plait.offload_io")
    monkeypatch.setattr(pieces, "offload_available", lambda: True)
    monkeypatch.setattr(pieces.importlib, "import_module", lambda name: fake)
    with pytest.raises(PieceMissingError, match="no ZeRO placement"):
        PlaitStrategy(zero=ZeroConfig(stage=3), offload="cpu")


def test_offload_uses_the_placement_offload_io_exposes(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    seen = []
    fake = types.ModuleType("plait.offload_io")
    fake.zero_placement = lambda config: seen.append(config) or "placement"
    monkeypatch.setattr(pieces, "offload_available", lambda: True)
    monkeypatch.setattr(pieces.importlib, "import_module", lambda name: fake)
    assert pieces.offload_placement_factory() is fake.zero_placement
    strategy = PlaitStrategy(zero=ZeroConfig(stage=2), offload="cpu")
    assert strategy.plait_config.offload == "cpu"


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_precision_the_strategy_cannot_honour(precision: str) -> None:
    with pytest.raises(ValueError, match="not supported by the plait strategies|cannot use the precision"):
        _trainer(strategy="plait_zero3", precision=precision)
    with pytest.raises(ValueError, match="not supported by the plait strategies|cannot use the precision"):
        L.Fabric(accelerator="cpu", devices=1, strategy="plait_zero3", precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_supported_precisions_become_the_plait_plugin(precision: str) -> None:
    trainer = _trainer(strategy="plait_zero3", precision=precision)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, plait.lightning.PlaitPrecision) and plugin.precision == precision
    with plugin.forward_context():
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert out.dtype == (torch.bfloat16 if precision == "bf16-mixed" else torch.float32)


def test_zero_config_contradicting_the_precision() -> None:
    strategy = PlaitStrategy(zero=ZeroConfig(stage=3, compute_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contradicts precision='32-true'"):
        _trainer(strategy=strategy)
    with pytest.raises(ValueError, match="loss_scale"):
        _trainer(strategy=PlaitStrategy(zero=ZeroConfig(loss_scale=128.0)), precision="bf16-mixed")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"gradient_clip_val": 1.0}, "contradicts ZeroConfig.max_grad_norm"),
    ({"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, "gradient_clip_algorithm='value'"),
])
def test_trainer_arguments_contradicting_the_config_fail_before_launch(kwargs: dict, match: str) -> None:
    strategy = PlaitStrategy(zero=ZeroConfig(stage=3, max_grad_norm=0.5))
    trainer = _trainer(strategy=strategy, **kwargs)
    with pytest.raises(ValueError, match=match):
        trainer.fit(TinyLlamaModule(TEST_MODEL, batch_size=2, seq_len=16))
    assert not dist.is_initialized()  # refused before any process group existed


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="offload.*stage=1"):
        PlaitConfig(zero=ZeroConfig(stage=1), offload="cpu")
    with pytest.raises(ValueError, match="offload='disk'"):
        PlaitConfig(offload="disk")
    with pytest.raises(ValueError, match="lacks"):
        PlaitConfig(extensions=(object(),))
    with pytest.raises(ValueError, match="not both"):
        PlaitStrategy(zero=ZeroConfig(stage=2), config=PlaitConfig())
    with pytest.raises(ValueError, match="must be a plait.zero_sharding.ZeroConfig"):
        PlaitConfig(zero={"stage": 3})


class _Supplies:
    order = 50

    def __init__(self, key: str) -> None:
        self.key = key

    def check(self, plan: object, precision: str) -> None:
        pass

    def apply(self, module: object, group: object) -> object:
        return module

    def zero_kwargs(self) -> dict[str, object]:
        return {self.key: object()}


def test_extensions_that_collide_are_refused() -> None:
    with pytest.raises(ValueError, match="both supply the ZeRO reducer"):
        PlaitStrategy(extensions=(_Supplies("reducer"), _Supplies("reducer")))
    with pytest.raises(ValueError, match="only"):
        PlaitStrategy(extensions=(_Supplies("optimizer"),))


def test_fabric_refuses_separate_optimizer_setup_and_value_clipping() -> None:
    strategy = PlaitFabricStrategy(zero=ZeroConfig(stage=2))
    with pytest.raises(ValueError, match=r"fabric.setup\(model, optimizer\)"):
        strategy.setup_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    with pytest.raises(ValueError, match="max_norm"):
        strategy.clip_gradients_value(torch.nn.Linear(1, 1), None, 1.0)


def test_num_nodes_gives_zero_the_ranks_per_node() -> None:
    """``num_nodes > 1``: ZeRO is told the layout (``devices`` ranks per node), so stage 3 reduces
    in two hops across nodes without reading it from the environment (tested in the zero-sharding
    package: ``test_zero_sharding_two_hop_default.py``, route ``given``)."""
    fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=PlaitFabricStrategy(ZeroConfig(stage=3)))
    plan, group = fabric.strategy._parallel_plan()
    assert group is None and plan.zero.ranks_per_node == 2 and plan.zero.two_hop_reduce
    one_node = L.Fabric(accelerator="cpu", devices=2, strategy=PlaitFabricStrategy(ZeroConfig(stage=3)))
    assert one_node.strategy._parallel_plan()[0].zero.ranks_per_node == "auto"
    plan = PlaitConfig(zero=ZeroConfig(ranks_per_node=4))
    assert pieces.with_nodes(plan, 2, 2, None) is plan  # the user's own layout wins
    assert pieces.with_nodes(PlaitConfig(), 2, 2, object()).zero.ranks_per_node == "auto"  # a subgroup: left alone
