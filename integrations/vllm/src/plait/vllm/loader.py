"""``load_format="plait_universal"``: vLLM loads a plait universal checkpoint directly.

``LLM(model=<dir>, load_format="plait_universal")`` where ``<dir>`` holds the HF ``config.json``
(with the right ``architectures``) and the tokenizer files, and is also the checkpoint (a
checkpoint root with ``step-*/`` directories, or one checkpoint directory with ``manifest.json``).
``model_loader_extra_config`` may name the checkpoint elsewhere and the state-dict key:

    LLM(model="serve/", load_format="plait_universal",
        model_loader_extra_config={"checkpoint": "runs/ckpt", "key": "model"})

Every tensor is handed over as a view of the mapped checkpoint file (or consolidated from the
producer's pieces, checked as it is read). In one process, when a core is free, a worker thread
checks the chunks while vLLM copies the tensors, and the loading thread checks what it has not
reached when the stream ends (:mod:`plait.vllm.checked_ahead`): a damaged chunk makes
``load_weights`` raise before the engine starts (its value may be in a parameter by then). With no
free core each tensor is checked before it is handed over. With tensor
parallelism vLLM's copy of a view hashes each block right after copying it, while it is in cache
(:mod:`plait.vllm.checked_copy`), so a rank reads and checks only the chunks of what it copies
(``"rank_rows": False`` reads every consolidated tensor whole).
A corrupted file stops start-up with an error naming it. vLLM's own ``model.load_weights`` then
does its qkv and gate|up fusion and tensor-parallel slicing.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from plait.universal_ckpt.mapped import MappedReader
from plait.vllm.checkpoint_weights import CheckpointWeights
from plait.vllm.tensor_parallel import TensorParallelRank

logger = logging.getLogger("plait.vllm")

LOAD_FORMAT = "plait_universal"
EXTRA_CONFIG_KEYS = ("checkpoint", "key", "verify", "rank_rows")


def _tensor_parallel_rank(model_config: ModelConfig) -> TensorParallelRank | None:
    """This process's TP rank, or None outside an initialised vLLM engine (TP=1: whole tensors)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return None
    heads = getattr(model_config.hf_text_config, "num_key_value_heads", None)
    return TensorParallelRank(rank=parallel_state.get_tensor_model_parallel_rank(), size=size,
                              num_key_value_heads=heads)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What one ``plait_universal`` load did in one process (``model.plait_universal_report``).

    Attributes:
        directory: the checkpoint directory read.
        seconds: the time ``load_weights`` took.
        tensor_parallel: ``(rank, size)`` when this rank read only its rows, else None.
        checked_bytes: bytes of the tensors handed over as mapped views that were checked, each
            read once for it (0 with ``verify=False``). For a rank that copies only its rows,
            less than ``mapped_bytes``.
        mapped_bytes: bytes of the tensors stored as one piece (handed over as mapped views); the
            others are consolidated from their pieces, checked as they are read.
        check_worker: at TP=1 with checks on, whether a worker thread checked alongside the copies
            (a core was free for it); None otherwise.
    """

    directory: str
    seconds: float
    tensor_parallel: tuple[int, int] | None
    checked_bytes: int
    mapped_bytes: int
    check_worker: bool | None = None


def load_report(model: nn.Module) -> LoadReport | None:
    """The :class:`LoadReport` a ``plait_universal`` load left on ``model`` (None for other load formats).

    Pass it to vLLM to get every rank's: ``llm.apply_model(plait.vllm.loader.load_report)`` (a
    module-level function, so vLLM's worker processes can unpickle it).
    """
    return getattr(model, "plait_universal_report", None)


class PlaitUniversalLoader(BaseModelLoader):
    """vLLM model loader for plait universal checkpoints (``load_format="plait_universal"``).

    Args:
        load_config: vLLM's ``LoadConfig``; its ``model_loader_extra_config`` may hold
            ``checkpoint`` (path; default: the model directory), ``key`` (the state-dict key of
            the model; default: the only key holding parameters), ``verify`` (default True) and
            ``rank_rows`` (default True: a tensor-parallel rank reads only its rows of the weights
            vLLM splits along dim 0, and its columns of the row-parallel ones split along dim 1).

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

    def _weights(self, model_config: ModelConfig, tensor_parallel: TensorParallelRank | None = None
                 ) -> CheckpointWeights:
        path = self.extra.get("checkpoint") or model_config.model
        return CheckpointWeights(path, key=self.extra.get("key"), verify=bool(self.extra.get("verify", True)),
                                 model_type=getattr(model_config.hf_config, "model_type", None),
                                 tensor_parallel=tensor_parallel)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: checks that the checkpoint is there and its manifest and file sizes are sound."""
        self._weights(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Stream the checkpoint's tensors into ``model.load_weights`` and check every parameter got one.

        Raises:
            CheckpointIntegrityError: a file fails its hash or size check (the message names it).
            ValueError: parameters of the model that the checkpoint does not hold (names them), a
                weight-only quantized checkpoint without ``quantization="plait_weight_only"``, or
                NaN in a parameter after a tensor-parallel rank read only its rows (the rows vLLM
                took differ from the rows read: says to pass ``"rank_rows": False``).
        """
        start = time.perf_counter()
        tensor_parallel = _tensor_parallel_rank(model_config) if self.extra.get("rank_rows", True) else None
        weights = self._weights(model_config, tensor_parallel)
        record = _quantization(weights, model_config)
        if tensor_parallel is None:  # whole tensors, checked alongside the copies on a free core (or each first)
            with weights.checked_ahead() as stream:
                loaded = model.load_weights(_in_layout(stream, record))
        else:  # each rank checks exactly the chunks of what vLLM copies, whatever its split
            with weights.checked_on_copy() as stream:
                loaded = model.load_weights(_in_layout(stream, record))
        if weights.nan_filled:
            _check_no_nan(model, weights)
        self.last_load_seconds = time.perf_counter() - start
        report = LoadReport(
            directory=str(weights.directory), seconds=self.last_load_seconds,
            tensor_parallel=(tensor_parallel.rank, tensor_parallel.size) if tensor_parallel else None,
            checked_bytes=weights.checked_bytes or 0,
            mapped_bytes=sum(e.nbytes for e in weights.entries() if MappedReader.whole_piece(e) is not None),
            check_worker=weights.checked_ahead_worker)
        model.plait_universal_report = report  # read back with llm.apply_model(load_report)
        logger.info("plait_universal: %s", report)
        if loaded is None:  # a model that does not report what it loaded: nothing to check
            return
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"plait_universal: {weights.directory} (key {weights.key!r}) has no tensor for "
                             f"{len(missing)} parameter(s) of {type(model).__name__}: {shown}. Save the whole model, "
                             f"or pass model_loader_extra_config={{'key': ...}} naming the key that holds it.")


def _quantization(weights: CheckpointWeights, model_config: ModelConfig) -> dict | None:
    """A weight-only quantized checkpoint's record (None if unquantized); refused unless vLLM runs
    it with ``quantization="plait_weight_only"``."""
    from plait.universal_ckpt.quantize import describe, scheme_of
    from plait.vllm.quantized import NAME

    record = scheme_of(weights.manifest)
    if record is not None and model_config.quantization != NAME:
        raise ValueError(
            f"plait_universal: {weights.directory} holds weights quantized {describe(record)}, but the engine runs "
            f"quantization={model_config.quantization!r}. Put the model's config.json with its quantization_config "
            f"beside the checkpoint (`plait ckpt quantize SRC DST --config HF_CONFIG` writes it) and serve with "
            f"quantization={NAME!r} (the default for such a config.json).")
    return record


def _in_layout(stream, record: dict | None):
    """The stream, with a quantized checkpoint's codes, scales and zero points in the pack-quantized names."""
    if record is None:
        return stream
    from plait.universal_ckpt.interop.hf_quantized import hf_tensors

    return (pair for name, tensor in stream for pair in hf_tensors(record, name, tensor))


def _check_no_nan(model: nn.Module, weights: CheckpointWeights) -> None:
    """A rank that read only some rows of a tensor split over several pieces got NaN elsewhere: if
    vLLM's loader took other rows than :mod:`plait.vllm.tensor_parallel` says, they show up here."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and bool(torch.isnan(param).any()):
            raise ValueError(
                f"plait_universal: parameter {name} holds NaN after loading {weights.directory} with per-rank row "
                f"reads ({len(weights.nan_filled)} tensors consolidated in part); pass model_loader_extra_config="
                "{'rank_rows': False} to read whole tensors, and report the model to plait-vllm.")


def register_loader() -> tuple[str, ...]:
    """Register :class:`PlaitUniversalLoader` as ``plait_universal`` (again is harmless).

    Returns:
        The load formats registered.
    """
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not PlaitUniversalLoader:
        register_model_loader(LOAD_FORMAT)(PlaitUniversalLoader)
    return (LOAD_FORMAT,)
