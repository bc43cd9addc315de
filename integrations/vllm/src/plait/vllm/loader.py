"""``load_format="plait_universal"``: vLLM loads a plait universal checkpoint directly.

``LLM(model=<dir>, load_format="plait_universal")`` where ``<dir>`` holds the HF ``config.json``
(with the right ``architectures``) and the tokenizer files, and is also the checkpoint (a
checkpoint root with ``step-*/`` directories, or one checkpoint directory with ``manifest.json``).
``model_loader_extra_config`` may name the checkpoint elsewhere and the state-dict key:

    LLM(model="serve/", load_format="plait_universal",
        model_loader_extra_config={"checkpoint": "runs/ckpt", "key": "model"})

Every tensor is consolidated from the producer's layout and hash-checked as it is read; a
corrupted file stops start-up with an error naming it. vLLM's own ``model.load_weights`` then does
its qkv and gate|up fusion and tensor-parallel slicing.
"""

from __future__ import annotations

import time

from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from plait.vllm.checkpoint_weights import CheckpointWeights

LOAD_FORMAT = "plait_universal"
EXTRA_CONFIG_KEYS = ("checkpoint", "key", "verify")


class PlaitUniversalLoader(BaseModelLoader):
    """vLLM model loader for plait universal checkpoints (``load_format="plait_universal"``).

    Args:
        load_config: vLLM's ``LoadConfig``; its ``model_loader_extra_config`` may hold
            ``checkpoint`` (path; default: the model directory), ``key`` (the state-dict key of
            the model; default: the only key holding parameters) and ``verify`` (default True).

    Raises:
        ValueError: ``model_loader_extra_config`` is not a dict or has keys other than those above.
    """

    def __init__(self, load_config) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config or {}
        if not isinstance(extra, dict):
            raise ValueError(f"model_loader_extra_config must be a dict for load_format={LOAD_FORMAT!r}, "
                             f"got {type(extra).__name__}; pass e.g. {{'checkpoint': '/path/to/ckpt'}}.")
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"model_loader_extra_config has keys {unknown} that load_format={LOAD_FORMAT!r} "
                             f"does not know; use only {list(EXTRA_CONFIG_KEYS)}.")
        self.extra = extra
        self.last_load_seconds: float | None = None

    def _weights(self, model_config: ModelConfig) -> CheckpointWeights:
        path = self.extra.get("checkpoint") or model_config.model
        return CheckpointWeights(path, key=self.extra.get("key"), verify=bool(self.extra.get("verify", True)),
                                 model_type=getattr(model_config.hf_config, "model_type", None))

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: checks that the checkpoint is there and its manifest and file sizes are sound."""
        self._weights(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Stream the checkpoint's tensors into ``model.load_weights`` and check every parameter got one.

        Raises:
            CheckpointIntegrityError: a file fails its hash or size check (the message names it).
            ValueError: parameters of the model that the checkpoint does not hold (names them).
        """
        start = time.perf_counter()
        weights = self._weights(model_config)
        loaded = model.load_weights(iter(weights))
        self.last_load_seconds = time.perf_counter() - start
        if loaded is None:  # a model that does not report what it loaded: nothing to check
            return
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"plait_universal: {weights.directory} (key {weights.key!r}) has no tensor for "
                             f"{len(missing)} parameter(s) of {type(model).__name__}: {shown}. Save the whole model, "
                             f"or pass model_loader_extra_config={{'key': ...}} naming the key that holds it.")


def register_loader() -> tuple[str, ...]:
    """Register :class:`PlaitUniversalLoader` as ``plait_universal`` (again is harmless).

    Returns:
        The load formats registered.
    """
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not PlaitUniversalLoader:
        register_model_loader(LOAD_FORMAT)(PlaitUniversalLoader)
    return (LOAD_FORMAT,)
