"""Which HF model families plait can patch, what it replaces in each, and which transformers it trusts.

A family is identified by ``model.config.model_type``. Its :class:`FamilySpec` names the modeling
module and the classes whose instances are patched; the classes are looked up by name at apply
time (transformers is imported lazily, never at module level), and a missing name is reported as
"this transformers changed the family's layout" before anything is modified.

Version policy: the patches rely on the layout of transformers 5.x modeling files (module-level
``apply_rotary_pos_emb`` called by the attention ``forward``, ``RMSNorm`` modules with ``weight``
and ``variance_epsilon``, gated MLPs with ``gate_proj``/``up_proj``/``down_proj``/``act_fn``, and
the ``@use_experts_implementation`` experts with ``_apply_gate``). Anything outside
:data:`TRANSFORMERS_RANGE` is refused with the range and a pip line.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import types

TRANSFORMERS_RANGE = ((5, 0), (6, 0))
"""Supported transformers versions: ``>= 5.0, < 6.0`` (verified on 5.19)."""

ACTIVATION_KINDS = {
    # HF ``hidden_act`` -> the plait gated op that computes act(gate) * up for it.
    "silu": ("silu", None),
    "swish": ("silu", None),
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_new": ("gelu", "tanh"),
}


class UnsupportedModelError(ValueError):
    """The model's family has no plait mapping, or its layout is not the one the mapping expects."""


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is missing or outside :data:`TRANSFORMERS_RANGE`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """What plait patches in one HF model family.

    Attributes:
        model_type: ``config.model_type`` of the family, e.g. ``"llama"``.
        module: dotted path of the family's modeling module.
        rms_norm_class: name of its RMSNorm class (every instance, including Qwen3's per-head
            q/k norms, is routed to ``plait.kernels.ops.rms_norm``).
        attention_class: name of its attention class (its rotary call goes to plait's rotary).
        rotary_class: name of its rotary-embedding class (used once at apply time to check the
            cos/sin layout the patch assumes).
        mlp_classes: names of its dense gated-MLP classes (``act(gate) * up`` -> ``silu_and_mul``
            on a fused gate|up GEMM); empty when the family has none.
        experts_class: name of its fused-experts class (gate applied by ``silu_and_mul``), or "".
    """

    model_type: str
    module: str
    rms_norm_class: str
    attention_class: str
    rotary_class: str
    mlp_classes: tuple[str, ...] = ()
    experts_class: str = ""

    def __post_init__(self) -> None:
        for field in ("model_type", "module", "rms_norm_class", "attention_class", "rotary_class"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ValueError(f"FamilySpec.{field}={value!r} must be a non-empty string; name the HF class.")
        if not isinstance(self.mlp_classes, tuple):
            raise ValueError(f"FamilySpec.mlp_classes={self.mlp_classes!r} must be a tuple of class names.")


def _spec(model_type: str, prefix: str, *, mlp: bool, experts: bool) -> FamilySpec:
    return FamilySpec(
        model_type=model_type,
        module=f"transformers.models.{model_type}.modeling_{model_type}",
        rms_norm_class=f"{prefix}RMSNorm",
        attention_class=f"{prefix}Attention",
        rotary_class=f"{prefix}RotaryEmbedding",
        mlp_classes=(f"{prefix}MLP",) if mlp else (),
        experts_class=f"{prefix}Experts" if experts else "",
    )


FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        _spec("llama", "Llama", mlp=True, experts=False),
        _spec("mistral", "Mistral", mlp=True, experts=False),
        _spec("qwen2", "Qwen2", mlp=True, experts=False),
        _spec("qwen3", "Qwen3", mlp=True, experts=False),
        _spec("mixtral", "Mixtral", mlp=False, experts=True),
        # Qwen-MoE: the shared expert (Qwen2) and dense layers (both) are ``*MoeMLP`` instances.
        _spec("qwen2_moe", "Qwen2Moe", mlp=True, experts=True),
        _spec("qwen3_moe", "Qwen3Moe", mlp=True, experts=True),
    )
}


def supported_families() -> tuple[str, ...]:
    """The ``model_type`` values plait can patch whose modeling module the installed transformers has.

    Returns:
        Sorted model types (all of :data:`FAMILIES` when transformers is missing: nothing to filter by).
    """
    present = []
    for model_type, spec in FAMILIES.items():
        try:
            found = importlib.util.find_spec(spec.module) is not None
        except ModuleNotFoundError:
            found = True
        if found:
            present.append(model_type)
    return tuple(sorted(present))


def parse_version(text: str) -> tuple[int, int, int]:
    """``"5.19.0.dev0"`` -> ``(5, 19, 0)``: the leading numeric release, suffixes ignored.

    Raises:
        UnsupportedTransformersError: no leading ``X.Y`` in ``text``.
    """
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise UnsupportedTransformersError(f"cannot read the transformers version {text!r}.")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def installed_transformers_version() -> str | None:
    """``transformers.__version__``, or None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def check_transformers_version(version: str | None = None) -> str:
    """Refuse a transformers outside :data:`TRANSFORMERS_RANGE`.

    Args:
        version: the version to check; default: the installed ``transformers.__version__``.

    Returns:
        The version string checked.

    Raises:
        UnsupportedTransformersError: transformers is not installed, or its version is out of range.
    """
    low, high = TRANSFORMERS_RANGE
    wanted = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if version is None:
        version = installed_transformers_version()
        if version is None:
            raise UnsupportedTransformersError(
                f"HF model patching needs transformers{wanted}; pip install 'transformers{wanted}'."
            )
    if not low <= parse_version(version)[:2] < high:
        raise UnsupportedTransformersError(
            f"plait.inference_kernels.patching supports transformers{wanted} (checked on 5.19); found "
            f"{version}. Its patches depend on the modeling-file layout of that range; "
            f"pip install 'transformers{wanted}', or use the plait ops directly."
        )
    return version


def family_of(model: object) -> FamilySpec:
    """The :class:`FamilySpec` for ``model`` (from ``model.config.model_type``).

    Raises:
        UnsupportedModelError: no config/model_type, or a family without a mapping; the message
            names the family and the supported list.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no config.model_type; pass a transformers PreTrainedModel "
            f"of one of the families {', '.join(supported_families())}."
        )
    spec = FAMILIES.get(model_type)
    if spec is None or model_type not in supported_families():
        raise UnsupportedModelError(
            f"model family {model_type!r} has no plait patch mapping; supported families: "
            f"{', '.join(supported_families())}. Use the plait ops directly for other models."
        )
    return spec


@dataclasses.dataclass(frozen=True)
class ResolvedFamily:
    """A :class:`FamilySpec` with its module and classes imported."""

    spec: FamilySpec
    module: types.ModuleType
    rms_norm: type
    attention: type
    rotary: type
    mlps: tuple[type, ...]
    experts: type | None


def resolve(spec: FamilySpec) -> ResolvedFamily:
    """Import the family's modeling module and look up every class the patch needs.

    Raises:
        UnsupportedModelError: a class or the module-level ``apply_rotary_pos_emb`` is missing
            (this transformers laid the family out differently).
    """
    module = importlib.import_module(spec.module)

    def lookup(name: str) -> type:
        found = getattr(module, name, None)
        if not isinstance(found, type):
            raise UnsupportedModelError(
                f"{spec.module} has no class {name}; this transformers lays out {spec.model_type!r} "
                f"differently from what plait's patch expects. Use transformers 5.19 or report it."
            )
        return found

    if not callable(getattr(module, "apply_rotary_pos_emb", None)):
        raise UnsupportedModelError(
            f"{spec.module} has no module-level apply_rotary_pos_emb; plait's rotary patch hooks that "
            f"function. Use transformers 5.19 or patch with rotary=False."
        )
    return ResolvedFamily(
        spec=spec,
        module=module,
        rms_norm=lookup(spec.rms_norm_class),
        attention=lookup(spec.attention_class),
        rotary=lookup(spec.rotary_class),
        mlps=tuple(lookup(name) for name in spec.mlp_classes),
        experts=lookup(spec.experts_class) if spec.experts_class else None,
    )
