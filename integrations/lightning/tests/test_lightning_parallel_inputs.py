"""``sp_size`` / ``ep_size`` inputs, refused before any process starts (plait-lightning alone).

Training with them needs plait-ulysses-sp / plait-moe-layers and lives in the top-level
``tests/test_lightning_sequence_parallel.py`` and ``tests/test_lightning_expert_parallel.py``; here
the two packages are made to look absent where the test is about their absence.
"""

from __future__ import annotations

import pytest

from plait.lightning import PieceMissingError, PlaitConfig, PlaitFabricStrategy, PlaitStrategy, parallel

L = pytest.importorskip("lightning")


@pytest.mark.parametrize("field", ["sp_size", "ep_size"])
@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True, None])
def test_bad_sizes_are_refused_naming_the_field(field: str, value: object) -> None:
    for build in (PlaitStrategy, PlaitFabricStrategy, PlaitConfig):
        with pytest.raises(ValueError, match=rf"^{field}={value!r} must be a positive int"):
            build(**{field: value})


@pytest.mark.parametrize(("field", "module", "line"), [
    ("sp_size", "plait.ulysses_sp", "pip install plait-ulysses-sp"),
    ("ep_size", "plait.moe_layers", "pip install plait-moe-layers"),
])
def test_missing_package_gives_the_pip_line(field: str, module: str, line: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = parallel.available
    monkeypatch.setattr(parallel, "available", lambda name: name != module and real(name))
    for build in (PlaitStrategy, PlaitFabricStrategy):
        with pytest.raises(PieceMissingError) as info:
            build(**{field: 2})
        assert str(info.value).endswith(line) and f"{field}=2 needs" in str(info.value)
    PlaitStrategy(**{field: 1})  # off: the package is never looked for


def test_sizes_must_divide_the_world() -> None:
    parallel.check_world_size(2, 1, 4)
    parallel.check_world_size(1, 4, 8)
    with pytest.raises(ValueError, match=r"^sp_size=3 does not divide the world size 4 .*use one of \[1, 2, 4\]"):
        parallel.check_world_size(3, 1, 4)
    with pytest.raises(ValueError, match=r"^ep_size=4 does not divide the world size 6"):
        parallel.check_world_size(1, 4, 6)
    parallel.check_world_size(2, 2, 8)
    with pytest.raises(ValueError, match=r"^sp_size=2 x ep_size=2 = 4 does not divide the world size 6"):
        parallel.check_world_size(2, 2, 6)


def test_config_and_sizes_are_not_given_twice() -> None:
    with pytest.raises(ValueError, match="not both"):
        PlaitStrategy(config=PlaitConfig(), sp_size=2)


def test_strategy_keeps_the_sizes() -> None:
    if not (parallel.available("plait.ulysses_sp") and parallel.available("plait.moe_layers")):
        pytest.skip("both optional pieces are needed to build the strategies with sizes above 1")
    assert PlaitStrategy(sp_size=2).plait_config.sp_size == 2
    assert PlaitFabricStrategy(ep_size=4).plait_config.ep_size == 4
    assert PlaitStrategy().plait_config.sp_size == PlaitStrategy().plait_config.ep_size == 1
