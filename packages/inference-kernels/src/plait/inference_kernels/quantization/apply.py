"""``quantize`` / ``revert`` / ``quantized``: weight-only quantization of an HF model, reversibly.

What is quantized: every ``nn.Linear`` of a model of a family plait's patching supports
(attention projections, dense and shared-expert MLPs), the fused MoE experts of transformers 5
(``*Experts.gate_up_proj``/``down_proj``, 3-D parameters: each expert's two weights, by
:class:`QuantizedExperts`; ``experts=False`` keeps them), optionally the output head and the input
embedding. The routers of transformers 5 (``*TopKRouter``, a bare weight, not a Linear) stay in
full precision; they and everything else with a weight that is not quantized are listed in
:attr:`QuantizeReport.kept` with the reason.

Every check runs before the first module is swapped: an unsupported family, a layer whose
``in_features`` the int4 group size does not divide, a weight dtype other than fp32/bf16/fp16, a
non-finite weight, or a ``skip`` pattern that names no Linear or experts module is refused, naming
the layer and the fix, with the model unchanged. ``revert`` puts the original modules back (exactly, by
default); ``quantize`` again with the same config returns the first report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterator

import torch
from torch import nn

from plait.inference_kernels.patching.apply import is_patched
from plait.inference_kernels.patching.registry import FamilySpec, family_of
from plait.inference_kernels.quantization.experts import QuantizedExperts, check_experts
from plait.inference_kernels.quantization.modules import QuantizedEmbedding, QuantizedLinear, check_cpu_kernel
from plait.kernels.ops.quant_matmul import SUPPORTED_DTYPES, QuantScheme, check_weight_shape, weight_nbytes

_STATE = "_plait_quant_state"


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """How :func:`quantize` quantizes a model.

    Attributes:
        kind: ``"int8"`` (per output channel, symmetric), ``"int4"`` (group-wise) or ``"fp6"``
            (e3m2, per output channel).
        group_size: int4 group size along in_features: 32, 64 (default for int4) or 128. Leave
            None for int8/fp6.
        symmetric: int4 only: False adds a uint8 zero point per group.
        head: also quantize the output head (``get_output_embeddings()``).
        embedding: also quantize the input embedding (``get_input_embeddings()``).
        experts: also quantize MoE families' fused experts (every expert's gate/up and down
            weight, int4 groups along H and I); False keeps them in full precision.
        skip: fnmatch patterns of module names to keep in full precision (e.g. ``"*.down_proj"``);
            each must match at least one Linear.
        keep_original: keep the original modules so :func:`revert` restores them bit for bit
            (costs their memory while quantized). False frees them; revert then puts back Linears
            holding the dequantized weights.
        cpu_kernels: on CPU use torch's weight-packed int8/int4 matmuls (False: the torch reference).
        cpu_bf16_decode: with fp32 activations on CPU, run those matmuls on the input rounded to
            bf16 for decode-sized inputs (< 32 rows); faster, but activations lose precision there.
            Applies to torch's kernels only.
        cpu_kernel: whose CPU kernels run int8/int4 (with ``cpu_kernels``): ``"torch"`` (default;
            torch's weight-packed matmuls, nothing to build) or ``"plait"`` (plait's AVX2 C++
            extension: fp32 activations; built on first use, which needs a C++ compiler (``c++``
            or ``$CXX``) and takes a few seconds, then cached). ``"plait"``
            where it cannot be built is refused before any weight changes.
    """

    kind: str = "int8"
    group_size: int | None = None
    symmetric: bool = True
    head: bool = False
    embedding: bool = False
    experts: bool = True
    skip: tuple[str, ...] = ()
    keep_original: bool = True
    cpu_kernels: bool = True
    cpu_bf16_decode: bool = False
    cpu_kernel: str = "torch"

    def __post_init__(self) -> None:
        self.scheme  # noqa: B018 - validates kind, group_size, symmetric (names the field)
        for name in ("head", "embedding", "experts", "keep_original", "cpu_kernels", "cpu_bf16_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QuantizeConfig.{name}={getattr(self, name)!r} must be True or False.")
        if not isinstance(self.skip, tuple) or not all(isinstance(p, str) and p for p in self.skip):
            raise ValueError(f"QuantizeConfig.skip={self.skip!r} must be a tuple of module-name patterns.")
        check_cpu_kernel(self.cpu_kernel, field="QuantizeConfig.cpu_kernel")

    @property
    def scheme(self) -> QuantScheme:
        """The :class:`QuantScheme` of every quantized weight."""
        group = self.group_size if self.group_size is not None or self.kind != "int4" else 64
        return QuantScheme(kind=self.kind, group_size=group, symmetric=self.symmetric)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeReport:
    """What :func:`quantize` did.

    Attributes:
        config: the config applied.
        family: the model's ``model_type``.
        quantized: names of the quantized modules.
        kept: ``(name, reason)`` of weights left in full precision.
        bytes_before: bytes of the quantized modules' original weights (experts: both 3-D tensors).
        bytes_after: bytes of their codes, scales and zero points (the formula of
            :func:`plait.kernels.ops.quant_matmul.weight_nbytes`).
    """

    config: QuantizeConfig
    family: str
    quantized: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass
class _State:
    report: QuantizeReport
    originals: dict[str, nn.Module | None]


def quantize_report(model: nn.Module) -> QuantizeReport | None:
    """The report of the quantization applied to ``model``, or None."""
    state = getattr(model, _STATE, None)
    return None if state is None else state.report


def is_quantized(model: nn.Module) -> bool:
    """Whether :func:`quantize` has been applied to ``model`` (and not reverted)."""
    return getattr(model, _STATE, None) is not None


def _targets(model: nn.Module, config: QuantizeConfig,
             spec: FamilySpec) -> tuple[dict[str, nn.Module], list[tuple[str, str]]]:
    """Modules to quantize and weights kept in full precision, before any change."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    targets: dict[str, nn.Module] = {}
    kept: list[tuple[str, str]] = []
    used = set()
    for name, module in model.named_modules():
        hit = [p for p in config.skip if fnmatch.fnmatchcase(name, p)]
        if isinstance(module, nn.Linear):
            used.update(hit)
            if module is head and not config.head:
                kept.append((name, "output head (QuantizeConfig.head=False)"))
            elif hit:
                kept.append((name, f"skipped by pattern {hit[0]!r}"))
            else:
                targets[name] = module
        elif spec.experts_class and type(module).__name__ == spec.experts_class:
            used.update(hit)
            if not config.experts:
                kept.append((name, "fused MoE experts (QuantizeConfig.experts=False)"))
            elif hit:
                kept.append((name, f"skipped by pattern {hit[0]!r}"))
            else:
                targets[name] = module
        elif isinstance(module, nn.Embedding) and module is embed:
            if config.embedding:
                targets[name] = module
            else:
                kept.append((name, "input embedding (QuantizeConfig.embedding=False)"))
        else:
            for pname, param in module.named_parameters(recurse=False):
                if param.dim() >= 2:
                    kept.append((f"{name}.{pname}", f"not a Linear ({type(module).__name__}): kept in full precision"))
    unused = [p for p in config.skip if p not in used]
    if unused:
        raise ValueError(f"QuantizeConfig.skip pattern(s) {unused} match no Linear or experts module of this model; "
                         "fix or drop them.")
    return targets, kept


def _check(targets: dict[str, nn.Module], scheme: QuantScheme) -> None:
    """Refuse, naming the layer, anything the scheme cannot hold (before any module changes)."""
    for name, module in targets.items():
        if not isinstance(module, nn.Linear | nn.Embedding):
            check_experts(name, module, scheme)
            continue
        w = module.weight
        if w.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: weight dtype {w.dtype} is not supported; cast the model to fp32, bf16 or fp16.")
        if w.device.type == "meta":
            raise ValueError(f"{name}: weight is on the meta device; load the weights before quantizing.")
        check_weight_shape(tuple(w.shape), scheme, name=name)
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{name}: weight holds inf or NaN; fix the checkpoint before quantizing.")


def _quantized_params(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """The weights of ``module`` that quantize replaces (a Linear's or embedding's, or the experts' two)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        return (module.weight,)
    return (module.gate_up_proj, module.down_proj)


def quantize(model: nn.Module, config: QuantizeConfig | None = None) -> QuantizeReport:
    """Replace the model's Linears and fused experts (optionally head/embedding) by quantized modules.

    Args:
        model: a transformers model of a family plait's patching supports.
        config: what and how to quantize (default int8).

    Returns:
        The :class:`QuantizeReport` (the same object on a repeated call with an equal config).

    Raises:
        UnsupportedModelError: the family is not supported (named, with the supported list).
        ValueError: already quantized with another config, patched with plait's kernels, or a
            layer the scheme cannot hold (named); the model is unchanged.
    """
    config = config or QuantizeConfig()
    state = getattr(model, _STATE, None)
    if state is not None:
        if state.report.config == config:
            return state.report
        raise ValueError("the model is already quantized with another QuantizeConfig; call revert(model) first.")
    if is_patched(model):
        raise ValueError("the model is patched with plait's kernels (its fused MLP caches the Linear weights); "
                         "revert the patch, quantize, then patch again with PatchConfig(mlp=False).")
    spec = family_of(model)
    scheme = config.scheme
    targets, kept = _targets(model, config, spec)
    _check(targets, scheme)
    originals: dict[str, nn.Module | None] = {}
    before = after = 0
    for name, module in targets.items():
        if isinstance(module, nn.Embedding):
            new = QuantizedEmbedding(module, scheme)
        elif isinstance(module, nn.Linear):
            new = QuantizedLinear(module, scheme, cpu_kernels=config.cpu_kernels,
                                  bf16_decode=config.cpu_bf16_decode, cpu_kernel=config.cpu_kernel)
        else:
            new = QuantizedExperts(module, scheme, cpu_kernels=config.cpu_kernels,
                                   bf16_decode=config.cpu_bf16_decode, cpu_kernel=config.cpu_kernel)
        before += sum(p.numel() * p.element_size() for p in _quantized_params(module))
        shapes = new.weight_shapes if isinstance(new, QuantizedExperts) else (new.weight_shape,)
        after += sum(weight_nbytes(shape, scheme) for shape in shapes)
        originals[name] = module if config.keep_original else None
        model.set_submodule(name, new)
    report = QuantizeReport(config=config, family=spec.model_type, quantized=tuple(targets), kept=tuple(kept),
                            bytes_before=before, bytes_after=after)
    setattr(model, _STATE, _State(report=report, originals=originals))
    return report


def revert(model: nn.Module) -> bool:
    """Undo :func:`quantize`: the original modules (or, without keep_original, dequantized Linears).

    Returns:
        True if the model was quantized, False if there was nothing to undo.
    """
    state = getattr(model, _STATE, None)
    if state is None:
        return False
    for name, original in state.originals.items():
        if original is None:
            current = model.get_submodule(name)
            if isinstance(current, QuantizedEmbedding):
                original = current.to_embedding()
            elif isinstance(current, QuantizedExperts):
                original = current.to_experts()
            else:
                original = current.to_linear()
        model.set_submodule(name, original)
    delattr(model, _STATE)
    return True


@contextlib.contextmanager
def quantized(model: nn.Module, config: QuantizeConfig | None = None) -> Iterator[QuantizeReport]:
    """``with quantized(model, config) as report:`` quantize on entry, revert on exit (also on error)."""
    report = quantize(model, config)
    try:
        yield report
    finally:
        revert(model)
