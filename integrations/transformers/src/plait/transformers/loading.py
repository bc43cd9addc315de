"""Big models straight into shards: ``sharded_from_pretrained`` builds an HF model with every
parameter on the meta device (plait-zero-sharding's ``sharded_init``) and remembers where its
weights are; the plait Trainer shards it and then fills each rank's shard from the safetensors
files, reading only that rank's byte ranges (plait-universal-ckpt's ``load_hf_weights``). No rank
ever holds the whole model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from plait.zero_sharding import sharded_init

WEIGHTS_ATTRIBUTE = "plait_pretrained_path"
_PIECE_PREFIX = "model."


def sharded_from_pretrained(path: str | os.PathLike, model_cls: Any = None, **config_kwargs: Any) -> nn.Module:
    """An HF model of ``path``'s config with meta parameters, to give a plait Trainer.

    Args:
        path: a local directory with ``config.json`` and ``*.safetensors`` (``save_pretrained``).
        model_cls: the model class (default ``AutoModelForCausalLM``).
        **config_kwargs: config fields to override.

    Returns:
        The model; training through ``with_plait(...)`` loads its weights into the shards.

    Raises:
        ValueError: ``path`` is not a directory holding safetensors files.
    """
    import transformers

    folder = Path(path)
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"sharded_from_pretrained(path={str(path)!r}): needs a local directory with config.json and "
                         "*.safetensors (save_pretrained output); download hub models first.")
    config = transformers.AutoConfig.from_pretrained(folder, **config_kwargs)
    cls = model_cls or transformers.AutoModelForCausalLM
    with sharded_init(init="meta"):  # weights come from the checkpoint: no initialisation to keep
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    setattr(model, WEIGHTS_ATTRIBUTE, str(folder))
    return model


def pending_weights(model: nn.Module) -> str | None:
    """Where the weights of a model built by :func:`sharded_from_pretrained` are, or ``None``."""
    return getattr(model, WEIGHTS_ATTRIBUTE, None)


def load_into_shards(model: nn.Module, path: str) -> list[str]:
    """Fill a sharded model's shards (parameters and fp32 masters) from ``path``'s safetensors.

    Returns:
        The parameter names filled.

    Raises:
        plait.universal_ckpt.CheckpointLayoutError: a parameter missing from the files, or a shape
            mismatch.
    """
    from plait.universal_ckpt.interop.hf import load_hf_weights

    filled = load_hf_weights(model, path, rename=lambda name: name.removeprefix(_PIECE_PREFIX))
    delattr(model, WEIGHTS_ATTRIBUTE)
    return filled


def move_buffers(model: nn.Module, device: Any) -> None:
    """Move only the buffers of a model whose parameters are still on the meta device (ZeRO
    allocates the parameters on the device when it shards)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta:
                module._buffers[name] = buf.to(device)
