"""Ulysses for Hugging Face transformers models, through transformers' own attention registry.

:func:`apply_ulysses` registers one attention implementation, ``"plait_ulysses"``, with
``transformers.AttentionInterface.register`` and switches the model to it with
``set_attn_implementation``; no modeling file is touched. The registered function does the
all-to-all, runs the model's previous implementation (``sdpa`` or ``eager``) on the head-sharded
tensors, and returns this rank's sequence slice. Because the name is not one of transformers'
mask implementations, the model builds no mask of its own (its local length would be wrong, and
it drops a 2-D ``attention_mask`` for such names). Instead a forward pre-hook on the decoder
stack (``model.base_model``, a documented torch hook, removed by :func:`remove_ulysses`) turns
what the model was called with (``attention_mask`` as this rank's slice or the whole sequence,
``key_padding_mask``, ``position_ids`` restarting for packed documents) into one whole-sequence
mask per forward, shared by every layer (:mod:`.masks`); it also fills in this rank's true
positions when ``position_ids`` is missing. transformers is imported lazily: this module is
usable only with the ``[hf]`` extra installed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.ulysses_sp.all_to_all import heads_to_seq
from plait.ulysses_sp.attention import gather_heads, head_layout
from plait.ulysses_sp.config import SUPPORTED_INNER, SPGroup, UlyssesConfig, sp_group
from plait.ulysses_sp.fpdt import fpdt_attention_forward
from plait.ulysses_sp.masks import global_mask, sp_attention_mask
from plait.ulysses_sp.tiled import tile_mlp, untile_mlp

ATTN_NAME = "plait_ulysses"
SUPPORTED_TRANSFORMERS = ((5, 0), (6, 0))  # [min, max): checked on 5.19
_STATE = "_plait_ulysses"
_HOOK = "_plait_ulysses_inputs_hook"
MASK_KWARG = "plait_sp_mask"  # the whole-sequence mask the pre-hook hands every layer


class UnsupportedModelError(ValueError):
    """The model's attention cannot be routed through ``AttentionInterface`` (the message says why)."""


@dataclasses.dataclass(frozen=True)
class _AttentionState:
    sp: SPGroup
    inner: str
    function: Callable[..., tuple[torch.Tensor, Any]]


def inner_function(module: nn.Module, inner: str, *, fpdt_chunk: int = 1024) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention function named ``inner`` as ``module`` would call it.

    ``"eager"`` is not in transformers' registry: each modeling file passes its own
    ``eager_attention_forward`` as the default, so it is taken from the module's modeling module.
    ``"fpdt"`` is plait's chunked attention (:func:`plait.ulysses_sp.fpdt.fpdt_attention_forward`)
    with ``fpdt_chunk`` tokens per chunk.

    Raises:
        UnsupportedModelError: no such function for this module.
    """
    from transformers import AttentionInterface

    if inner == "fpdt":
        return functools.partial(fpdt_attention_forward, chunk=fpdt_chunk)
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
                      is_causal: bool | None = None, plait_sp_mask: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"plait_ulysses"`` attention implementation (transformers' attention-function signature).

    Args:
        module: the HF attention module (carries the state :func:`apply_ulysses` attached).
        query: ``[B, H, S/P, D]`` after RoPE (true positions: pass global ``position_ids``).
        key: ``[B, H_kv, S/P, D]``.
        value: like ``key``.
        attention_mask: must be ``None`` (the model builds no mask for this name; a 4-D mask the
            caller passed through is refused).
        dropout: attention dropout.
        scaling: softmax scale.
        is_causal: defaults to the module's ``is_causal``.
        plait_sp_mask: ``[B, 1, S, S]`` bool over the whole sequence (True = attend), built once
            per forward by the pre-hook; ``None`` when the causal triangle alone is right.
        **kwargs: passed to the inner implementation.

    Returns:
        ``([B, S/P, H, D], None)`` like transformers' own implementations.

    Raises:
        RuntimeError: the module was not prepared by :func:`apply_ulysses`.
        ValueError: a 4-D ``attention_mask`` reached the attention (it cannot be split).
    """
    state: _AttentionState | None = getattr(module, _STATE, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs attn_implementation={ATTN_NAME!r} without "
                           "apply_ulysses(model, mesh); call that instead of setting the name by hand.")
    if attention_mask is not None:
        raise ValueError(f"{type(module).__name__} got a {attention_mask.dim()}-D attention_mask under Ulysses; "
                         "pass the 2-D padding mask (and position_ids for packed rows) to the model instead.")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    layer = getattr(module, "layer_idx", None)
    where = "" if layer is None else f", layer {layer}"
    (q, k, v), seq = gather_heads(query, key, value, state.sp, where)
    mask = inner_mask(plait_sp_mask, inner=state.inner, seq=seq, causal=causal, like=q)
    out, _ = state.function(_LocalHeads(module), q, k, v, mask, dropout=dropout, scaling=scaling,
                            is_causal=causal and mask is None, **kwargs)
    layout = head_layout(state.sp.size, query.shape[1], key.shape[1])
    out = heads_to_seq(out.transpose(1, 2), layout.q_splits, state.sp.rank, state.sp.group,
                       f"Ulysses all-to-all of the attention output, heads to sequence{where}")
    return out.transpose(1, 2), None


def inner_mask(keep: torch.Tensor | None, *, inner: str, seq: int, causal: bool,
               like: torch.Tensor) -> torch.Tensor | None:
    """The mask in the form the inner implementation takes.

    SDPA and FPDT take the boolean mask as it is (no ``[B, 1, S, S]`` float copy per layer) and needs none
    for plain causal attention (its kernels apply the triangle); eager adds its mask to the
    scores, so it gets an additive float mask, the causal triangle included.
    """
    if inner in ("sdpa", "fpdt"):
        return keep
    if keep is None:
        keep = global_mask(None, seq=seq, causal=causal, device=like.device)
        if keep is None:
            return None
    return torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill(~keep, torch.finfo(like.dtype).min)


def _positional_names(module: nn.Module) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(module.forward).parameters.values() if p.kind in kinds]


def prepare_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any], *, sp: SPGroup,
                   causal: bool) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook of the decoder stack: one whole-sequence mask per forward, true positions.

    Args:
        module: the decoder stack (``model.base_model``).
        args: its positional arguments (bound to their names here).
        kwargs: its keyword arguments: ``attention_mask`` (``[B, S/P]`` or ``[B, S]``),
            ``key_padding_mask`` (``[B, S]``), ``position_ids`` (``[B, S/P]``) are read.
        sp: the group.
        causal: whether the model's attention is causal.

    Returns:
        No positional arguments, and the keyword arguments with ``attention_mask`` and
        ``key_padding_mask`` replaced by ``plait_sp_mask`` and ``position_ids`` filled in.
    """
    kwargs = {**dict(zip(_positional_names(module), args, strict=False)), **kwargs}
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        return (), kwargs
    batch, local_len = tokens.shape[:2]
    if kwargs.get("position_ids") is None:  # the model would count from 0 on every rank: give true positions
        kwargs["position_ids"] = (sp.rank * local_len + torch.arange(local_len, device=tokens.device)).expand(
            batch, local_len)
    kwargs[MASK_KWARG] = sp_attention_mask(
        sp, local_len=local_len, causal=causal, device=tokens.device, attention_mask=kwargs.pop("attention_mask", None),
        key_padding_mask=kwargs.pop("key_padding_mask", None), position_ids=kwargs["position_ids"])
    kwargs["attention_mask"] = None
    return (), kwargs


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

    Feed it this rank's slice (``shard_batch``): ``input_ids``, global ``position_ids`` (restarting
    inside a row for packed documents), ``shift_labels``, and the padding as ``attention_mask``
    (this rank's slice or the whole sequence) or ``key_padding_mask`` (the whole sequence).

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through ``AttentionInterface``.
        mesh: a mesh with ``config.sp_dim``, a 1-D mesh, a process group or ``None`` (world).
        config: options (:class:`UlyssesConfig`).

    Returns:
        ``model``.

    Raises:
        ValueError: the model is already ZeRO-sharded (wrong order), or fewer query heads than sp ranks.
        UnsupportedModelError: the model does not use ``AttentionInterface``, has no attention
            module we recognise, or runs an inner attention other than sdpa/eager/fpdt (named).
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
    if inner not in SUPPORTED_INNER:
        raise UnsupportedModelError(f"{name} uses attn_implementation={inner!r}; Ulysses runs sdpa, eager or fpdt "
                                    "inside. Pass UlyssesConfig(inner_attention='sdpa').")
    sp = sp_group(mesh, sp_dim=config.sp_dim)
    text = model.config.get_text_config()
    head_layout(sp.size, text.num_attention_heads, getattr(text, "num_key_value_heads", None)
                or text.num_attention_heads)  # refuse impossible head splits before any work
    states = [_AttentionState(sp=sp, inner=inner, function=inner_function(m, inner, fpdt_chunk=config.fpdt_chunk))
              for m in modules]
    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    model._plait_ulysses_previous = previous
    model.set_attn_implementation(ATTN_NAME)
    for module, state in zip(modules, states, strict=True):
        setattr(module, _STATE, state)
    _register_inputs_hook(model, sp, modules)
    if config.tiled_mlp_chunks and config.tiled_mlp_chunks > 1:
        for mlp in decoder_mlps(model):
            tile_mlp(mlp, chunks=config.tiled_mlp_chunks)
    return model


def _register_inputs_hook(model: nn.Module, sp: SPGroup, modules: list[nn.Module]) -> None:
    causal = {bool(getattr(m, "is_causal", True)) for m in modules}
    if len(causal) != 1:
        raise UnsupportedModelError(f"{type(model).__name__} mixes causal and non-causal attention layers; Ulysses "
                                    "builds one mask per forward: wrap its attention in DistributedAttention.")
    stack = model.base_model
    old = getattr(stack, _HOOK, None)
    if old is not None:  # idempotent: one hook, with the current group
        old.remove()
    hook = functools.partial(prepare_inputs, sp=sp, causal=causal.pop())
    setattr(stack, _HOOK, stack.register_forward_pre_hook(hook, with_kwargs=True))


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
    hook = getattr(model.base_model, _HOOK, None)
    if hook is not None:
        hook.remove()
        delattr(model.base_model, _HOOK)
    del model._plait_ulysses_previous
    return model


def is_ulysses(model: nn.Module) -> bool:
    """Whether :func:`apply_ulysses` is in effect on ``model``."""
    return getattr(model, "_plait_ulysses_previous", None) is not None
