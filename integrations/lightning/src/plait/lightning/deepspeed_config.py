"""``PlaitStrategy.from_deepspeed``: a Lightning DeepSpeed setup (config or strategy name) switched to plait.

A script that used ``DeepSpeedStrategy(config=ds_config)`` or ``strategy="deepspeed_stage_3"``
changes that one argument to ``PlaitStrategy.from_deepspeed(ds_config)`` /
``PlaitStrategy.from_deepspeed("deepspeed_stage_3")``. The config goes through
:func:`plait.zero_sharding.deepspeed.config.translate` (every key mapped, accepted or refused by
its path) without the batch rule: as with Lightning's DeepSpeedStrategy, the loaders set the
batch and the Trainer's ``precision=`` the compute dtype.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from plait.zero_sharding import ZeroConfig

# Lightning's DeepSpeed strategy names -> (ZeRO stage, offload device or None), as Lightning registers them.
DEEPSPEED_NAMES: dict[str, tuple[int, str | None]] = {
    "deepspeed": (2, None), "deepspeed_stage_1": (1, None), "deepspeed_stage_2": (2, None),
    "deepspeed_stage_2_offload": (2, "cpu"), "deepspeed_stage_3": (3, None), "deepspeed_stage_3_offload": (3, "cpu"),
    "deepspeed_stage_3_offload_nvme": (3, "nvme"),
}


def strategy_kwargs(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The ``PlaitStrategy`` keyword arguments for a DeepSpeed config or strategy name.

    Args:
        config: a ``ds_config`` dict, a path to its JSON file, or one of :data:`DEEPSPEED_NAMES`.

    Returns:
        ``{"zero": ZeroConfig, "offload": device or None}``.

    Raises:
        ValueError: an unknown name; a config key plait refuses (named by its path); an
            ``optimizer``/``scheduler`` block (Lightning takes them from ``configure_optimizers``).
    """
    if isinstance(config, str) and not config.endswith(".json") and not os.path.exists(config):
        if config not in DEEPSPEED_NAMES:
            raise ValueError(f"{config!r} is not one of Lightning's DeepSpeed strategy names {sorted(DEEPSPEED_NAMES)}"
                             "; pass one of them, a ds_config dict or a JSON path.")
        stage, offload = DEEPSPEED_NAMES[config]
        return {"zero": ZeroConfig(stage=stage), "offload": offload}
    from plait.zero_sharding.deepspeed.config import load_config, translate

    tree = load_config(config)
    for block in ("optimizer", "scheduler"):
        if tree.get(block):
            raise ValueError(f"{block}: with Lightning the LightningModule's configure_optimizers builds the "
                             f"optimizer and scheduler; remove the {block} block and build them there "
                             "(plait.zero_sharding.deepspeed.schedules has DeepSpeed's schedules).")
    plan = translate(tree, world_size=None)
    # The Trainer's precision= sets the compute dtype, as it does for Lightning's DeepSpeedStrategy.
    zero = dataclasses.replace(plan.zero, compute_dtype=torch.float32)
    return {"zero": zero, "offload": plan.extensions.get("offload")}
