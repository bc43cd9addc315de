"""PlaitStrategy.from_deepspeed: Lightning's DeepSpeed names and a ds_config switch to plait by one changed argument."""

import importlib.util
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from plait.lightning import PlaitStrategy  # noqa: E402
from plait.lightning.deepspeed_config import DEEPSPEED_NAMES  # noqa: E402
from plait.lightning.pieces import PieceMissingError  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_environ():
    """An in-process fit leaves MASTER_PORT and the rank variables in os.environ; later tests'
    child processes would inherit them and collide on that port."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

CONFIG = {
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1e6},
    "bf16": {"enabled": True}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 100,
}


def test_names_match_lightnings_deepspeed_registry() -> None:
    registry = pl.strategies.StrategyRegistry
    names = {name for name in registry if name.startswith("deepspeed")}
    assert names == set(DEEPSPEED_NAMES)
    has_offload = importlib.util.find_spec("plait.offload_io") is not None
    for name in names:
        params = registry[name]["init_params"]
        if params.get("offload_optimizer") and not has_offload:  # installed alone: the piece is named
            with pytest.raises(PieceMissingError, match="pip install plait-offload-io"):
                PlaitStrategy.from_deepspeed(name)
            continue
        strategy = PlaitStrategy.from_deepspeed(name)
        assert strategy.plait_config.zero.stage == params.get("stage", 2), name
        offload = params.get("offload_optimizer_device", "cpu") if params.get("offload_optimizer") else None
        assert strategy.plait_config.offload == offload or getattr(strategy.plait_config.offload, "device",
                                                                   None) == offload, name


def test_config_maps_zero_keys_and_refuses_what_lightning_owns() -> None:
    zero = PlaitStrategy.from_deepspeed(CONFIG).plait_config.zero
    assert (zero.stage, zero.param_persistence_threshold, zero.reduce_bucket_elements) == (3, 0, 1_000_000)
    assert zero.max_grad_norm == 1.0 and zero.compute_dtype == torch.float32  # precision= on the Trainer decides
    with pytest.raises(ValueError, match="optimizer: with Lightning the LightningModule's configure_optimizers"):
        PlaitStrategy.from_deepspeed({**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    with pytest.raises(ValueError, match=r"zero_optimization.mics_shard_size: MiCS is not in plait"):
        PlaitStrategy.from_deepspeed({**CONFIG, "zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    with pytest.raises(ValueError, match="'deepspeed_stage_4' is not one of Lightning's DeepSpeed strategy names"):
        PlaitStrategy.from_deepspeed("deepspeed_stage_4")


class _Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(strategy, tmp_path) -> list[float]:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = torch.utils.data.TensorDataset(x, x @ torch.linspace(-1, 1, 8)[:, None])
    module = _Module()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=16,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return module.losses


def test_fit_with_a_deepspeed_config_equals_the_hand_built_strategy(tmp_path) -> None:
    from plait.zero_sharding import ZeroConfig

    ours = _fit(PlaitStrategy.from_deepspeed(CONFIG), tmp_path / "a")
    hand = _fit(PlaitStrategy(ZeroConfig(stage=3, overlap_comm=True, param_persistence_threshold=0,
                                         reduce_bucket_elements=1_000_000, max_grad_norm=1.0)), tmp_path / "b")
    assert len(ours) == 16 and ours == hand
    assert sum(ours[-4:]) < sum(ours[:4])  # it trains
