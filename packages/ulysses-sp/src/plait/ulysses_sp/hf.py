"""Ulysses for Hugging Face transformers models, through transformers' own attention registry.

:func:`apply_ulysses` registers one attention implementation, ``"plait_ulysses"``, with
``transformers.AttentionInterface.register`` and switches the model to it with
``set_attn_implementation``; no modeling file is touched. The registered function does the
all-to-all, runs the model's previous implementation (``sdpa`` or ``eager``) on the head-sharded
tensors, and returns this rank's sequence slice. Because the name is not one of transformers'
mask implementations, the model builds no mask of its own (its local length would be wrong):
causality comes from the inner implementation over global positions, and padding from the
``key_padding_mask`` keyword the caller passes to ``model(...)`` (``shard_batch`` provides it).
transformers is imported lazily: this module is usable only with the ``[hf]`` extra installed.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.ulysses_sp.all_to_all import heads_to_seq
from plait.ulysses_sp.attention import gather_heads, global_mask, head_layout
from plait.ulysses_sp.config import SPGroup, UlyssesConfig, sp_group
from plait.ulysses_sp.tiled import tile_mlp, untile_mlp

ATTN_NAME = "plait_ulysses"
SUPPORTED_TRANSFORMERS = ((5, 0), (6, 0))  # [min, max): checked on 5.19
_STATE = "_plait_ulysses"


class UnsupportedModelError(ValueError):
    """The model's attention cannot be routed through ``AttentionInterface`` (the message says why)."""


@dataclasses.dataclass(frozen=True)
class _AttentionState:
    sp: SPGroup
    inner: str
    function: Callable[..., tuple[torch.Tensor, Any]]


def inner_function(module: nn.Module, inner: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention function named ``inner`` as ``module`` would call it.

    ``"eager"`` is not in transformers' registry: each modeling file passes its own
    ``eager_attention_forward`` as the default, so it is taken from the module's modeling module.

    Raises:
        UnsupportedModelError: no such function for this module.
    """
    from transformers import AttentionInterface

    if inner != "eager":
        return AttentionInterface()[inner]
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise UnsupportedModelError(f"{type(module).__name__}'s modeling module has no eager_attention_forward; "
                                    "use UlyssesConfig(inner_attention='sdpa').")
    return function


class _LocalHeads:
    """The attention module as the inner implementation sees it: kv already expanded per query head."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, key_padding_mask: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"plait_ulysses"`` attention implementation (transformers' attention-function signature).

    Args:
        module: the HF attention module (carries the state :func:`apply_ulysses` attached).
        query: ``[B, H, S/P, D]`` after RoPE (true positions: pass global ``position_ids``).
        key: ``[B, H_kv, S/P, D]``.
        value: like ``key``.
        attention_mask: ignored (always ``None``: the model builds no mask for this name).
        dropout: attention dropout.
        scaling: softmax scale.
        is_causal: defaults to the module's ``is_causal``.
        key_padding_mask: ``[B, S]`` over the whole sequence, True for real tokens.
        **kwargs: passed to the inner implementation.

    Returns:
        ``([B, S/P, H, D], None)`` like transformers' own implementations.

    Raises:
        RuntimeError: the module was not prepared by :func:`apply_ulysses`.
    """
    state: _AttentionState | None = getattr(module, _STATE, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs attn_implementation={ATTN_NAME!r} without "
                           "apply_ulysses(model, mesh); call that instead of setting the name by hand.")
    del attention_mask
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    layer = getattr(module, "layer_idx", None)
    where = "" if layer is None else f", layer {layer}"
    (q, k, v), seq = gather_heads(query, key, value, state.sp, where)
    mask = None
    if key_padding_mask is not None or state.inner != "sdpa":  # eager needs its causal triangle as a mask
        keep = global_mask(key_padding_mask, seq=seq, causal=causal, device=q.device)
        if keep is not None:
            mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)
    out, _ = state.function(_LocalHeads(module), q, k, v, mask, dropout=dropout, scaling=scaling,
                   is_causal=causal and mask is None, **kwargs)
    layout = head_layout(state.sp.size, query.shape[1], key.shape[1])
    out = heads_to_seq(out.transpose(1, 2), layout.q_splits, state.sp.rank, state.sp.group,
                       f"Ulysses all-to-all of the attention output, heads to sequence{where}")
    return out.transpose(1, 2), None


def check_transformers_version() -> None:
    """Refuse transformers versions outside the range this adapter was written for.

    Raises:
        ImportError: transformers is missing (with the pip line) or outside the range.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("apply_ulysses needs transformers: pip install 'plait-ulysses-sp[hf]'") from exc
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= version < high:
        raise ImportError(f"transformers {transformers.__version__} is outside plait-ulysses-sp's supported range "
                          f">={low[0]}.{low[1]},<{high[0]}.{high[1]}; install a version in that range.")


def check_order(model: nn.Module) -> None:
    """Refuse a model that ZeRO already sharded: the order is SP -> MoE -> checkpointing/offload -> ZeRO.

    Raises:
        ValueError: ``model`` is a plait ZeRO module (found by class name, so zero-sharding need not
            be installed).
    """
    if any(cls.__name__ == "ZeroModule" for cls in type(model).__mro__):
        raise ValueError(f"{type(model).__name__} is already ZeRO-sharded; apply_ulysses must come first "
                         "(sequence parallel -> MoE -> checkpointing/offload -> ZeRO): call apply_ulysses(model, "
                         "mesh) before zero_shard(model, ...).")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules: those that call ``AttentionInterface`` (``is_causal`` + ``head_dim``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")
            and hasattr(m, "head_dim") and hasattr(m, "is_causal")]


def apply_ulysses(model: nn.Module, mesh: Any = None, *, config: UlyssesConfig | None = None) -> nn.Module:
    """Make an HF model sequence-parallel over ``mesh``'s sp dimension, in place (:func:`remove_ulysses` undoes it).

    Feed it this rank's slice (``shard_batch``): ``input_ids``, global ``position_ids``,
    ``shift_labels`` and ``key_padding_mask`` when there is padding.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through ``AttentionInterface``.
        mesh: a mesh with ``config.sp_dim``, a 1-D mesh, a process group or ``None`` (world).
        config: options (:class:`UlyssesConfig`).

    Returns:
        ``model``.

    Raises:
        ValueError: the model is already ZeRO-sharded (wrong order), or fewer query heads than sp ranks.
        UnsupportedModelError: the model does not use ``AttentionInterface``, has no attention
            module we recognise, or runs an inner attention other than sdpa/eager (named).
        ImportError: transformers missing or out of range.
    """
    check_transformers_version()
    from transformers import AttentionInterface, PreTrainedModel

    config = config or UlyssesConfig()
    name = type(model).__name__
    check_order(model)
    if not isinstance(model, PreTrainedModel) or not model._can_set_attn_implementation():
        raise UnsupportedModelError(f"{name} does not route attention through transformers' AttentionInterface, "
                                    "so Ulysses cannot be plugged in; wrap its attention in DistributedAttention.")
    modules = attention_modules(model)
    if not modules:
        raise UnsupportedModelError(f"{name} has no attention module with head_dim/is_causal to wrap.")
    previous = getattr(model, "_plait_ulysses_previous", None) or model.config._attn_implementation
    inner = config.inner_attention or previous
    if inner not in ("sdpa", "eager"):
        raise UnsupportedModelError(f"{name} uses attn_implementation={inner!r}; Ulysses runs sdpa or eager inside. "
                                    "Pass UlyssesConfig(inner_attention='sdpa').")
    sp = sp_group(mesh, sp_dim=config.sp_dim)
    text = model.config.get_text_config()
    head_layout(sp.size, text.num_attention_heads, getattr(text, "num_key_value_heads", None)
                or text.num_attention_heads)  # refuse impossible head splits before any work
    states = [_AttentionState(sp=sp, inner=inner, function=inner_function(m, inner)) for m in modules]
    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    model._plait_ulysses_previous = previous
    model.set_attn_implementation(ATTN_NAME)
    for module, state in zip(modules, states, strict=True):
        setattr(module, _STATE, state)
    if config.tiled_mlp_chunks and config.tiled_mlp_chunks > 1:
        for mlp in decoder_mlps(model):
            tile_mlp(mlp, chunks=config.tiled_mlp_chunks)
    return model


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' MLP modules (attributes named ``mlp``)."""
    return [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "mlp"]


def remove_ulysses(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_ulysses`: the previous attention implementation, untiled MLPs (no-op if not applied)."""
    previous = getattr(model, "_plait_ulysses_previous", None)
    if previous is None:
        return model
    model.set_attn_implementation(previous)
    for module in attention_modules(model):
        if hasattr(module, _STATE):
            delattr(module, _STATE)
    for mlp in decoder_mlps(model):
        untile_mlp(mlp)
    del model._plait_ulysses_previous
    return model


def is_ulysses(model: nn.Module) -> bool:
    """Whether :func:`apply_ulysses` is in effect on ``model``."""
    return getattr(model, "_plait_ulysses_previous", None) is not None
