"""``apply`` / ``revert`` / ``patched``: put plait's kernels into an HF model and take them out again.

What is patched (see docs/patches.md for the ledger):

* every ``*RMSNorm`` instance: ``forward`` -> ``plait.kernels.ops.rms_norm``;
* every dense gated ``*MLP`` instance: ``forward`` -> one GEMM on ``[W_gate; W_up]`` and
  ``silu_and_mul`` / ``gelu_and_mul`` (the original weights stay the parameters; the fused copy
  is a cache);
* every ``*Attention`` instance: its call of ``apply_rotary_pos_emb`` -> plait's rotary (in place
  under no_grad, differentiable otherwise), through a dispatcher that is a no-op for other models;
* every ``*Experts`` instance of MoE families: ``_apply_gate`` -> ``silu_and_mul`` (used by the
  ``grouped_mm``/``batched_mm`` experts implementations; ``eager`` inlines ``act(gate) * up``, so it
  is reported as skipped).

The patch is per model instance, reversible (``revert`` restores the instances' attributes and
the modeling module exactly), idempotent (a second ``apply`` with the same config returns the
first report), and refuses unknown families and transformers versions before touching anything.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Iterator

import torch

from plait.inference_kernels.patching import forwards
from plait.inference_kernels.patching.registry import (
    ACTIVATION_KINDS,
    ResolvedFamily,
    check_transformers_version,
    family_of,
    resolve,
)
from plait.kernels.dispatch import select_backend

_STATE = "_plait_patch_state"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchConfig:
    """Which parts of a model :func:`apply` replaces.

    Attributes:
        rms_norm: route RMSNorm modules to ``plait.kernels.ops.rms_norm``.
        mlp: route dense gated MLPs to a fused gate|up GEMM plus ``silu_and_mul``/``gelu_and_mul``.
            Costs one extra copy of ``W_gate`` and ``W_up`` per layer while patched (freed by revert).
        rotary: route the attention's rotary embedding to plait's rotary.
        experts: route MoE experts' gate activation to ``silu_and_mul``.
        policy: ``"auto"`` (default): patch only where plait's Triton kernels run (the model's
            parameters on CUDA with Triton installed); where plait's ops would run their torch
            reference (CPU), which is not faster than the model's own code (see the package
            README's patched-model table), keep the model's code and say so in
            :attr:`PatchReport.kept`. ``"always"``: patch what the other fields select
            on any device (tests of the patching itself, the reference path on purpose).
    """

    rms_norm: bool = True
    mlp: bool = True
    rotary: bool = True
    experts: bool = True
    policy: str = "auto"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "policy":
                if value not in ("auto", "always"):
                    raise ValueError(f"PatchConfig.policy={value!r}: use 'auto' (only where plait's kernels are "
                                     "faster, i.e. Triton on CUDA) or 'always'.")
            elif not isinstance(value, bool):
                raise ValueError(f"PatchConfig.{field.name}={value!r} must be True or False.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchReport:
    """What :func:`apply` did.

    Attributes:
        family: the model's ``model_type``.
        transformers_version: the transformers version checked.
        config: the :class:`PatchConfig` applied.
        patched: ``{"rms_norm": n, "mlp": n, "attention_rotary": n, "experts_gate": n}``, module counts.
        skipped: reasons for each part that was asked for but could not be patched.
        kept: parts left to the model's own code because plait's op would not be faster on the
            model's device (``policy="auto"``), with the reason.
    """

    family: str
    transformers_version: str
    config: PatchConfig
    patched: dict[str, int]
    skipped: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


@dataclasses.dataclass(eq=False)  # identity hash: states are members of the rotary hook's WeakSet
class _State:
    report: PatchReport
    family: ResolvedFamily
    forwards: list[torch.nn.Module]
    gates: list[torch.nn.Module]
    rotary_hooked: bool

    def __deepcopy__(self, memo: dict) -> _State:
        # copy.deepcopy(patched_model) gives a patched copy: the instance forwards are rebound to
        # the copied modules by deepcopy itself; the state must point at those copies and count as
        # one more user of the modeling module's rotary hook (the module itself is not copied).
        clone = _State(report=self.report, family=self.family, forwards=copy.deepcopy(self.forwards, memo),
                       gates=copy.deepcopy(self.gates, memo), rotary_hooked=self.rotary_hooked)
        if clone.rotary_hooked:
            forwards.acquire_rotary_hook(clone.family.module, clone)
        return clone


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched by :func:`apply`."""
    return _STATE in model.__dict__


def patch_report(model: torch.nn.Module) -> PatchReport | None:
    """The report of the patch currently on ``model``, or None."""
    state = model.__dict__.get(_STATE)
    return None if state is None else state.report


def _activation_kind(model: torch.nn.Module, family: str) -> tuple[tuple[str, str | None] | None, str]:
    act = getattr(model.config, "hidden_act", None)
    kind = ACTIVATION_KINDS.get(act) if isinstance(act, str) else None
    if kind is None:
        return None, (f"{family}: hidden_act={act!r} has no plait gated op "
                      f"(supported: {', '.join(ACTIVATION_KINDS)}); MLP/experts left as they are")
    return kind, ""


_ROTARY_PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]


def _rotary_layout_ok(model: torch.nn.Module, family: ResolvedFamily) -> str:
    """Check once that the hook can stand in for the family's rotary; '' if so, else the reason.

    The modeling module's ``apply_rotary_pos_emb`` must have the 5.x signature the hook
    implements, and the model's cos/sin must be ``cat(freqs, freqs)`` over the full head.
    """
    function = family.module.apply_rotary_pos_emb
    function = getattr(function, "original", function)  # our own hook, if another model installed it
    parameters = list(inspect.signature(function).parameters)
    if parameters != _ROTARY_PARAMETERS:
        return (f"rotary: {family.spec.module}.apply_rotary_pos_emb takes {parameters}, not "
                f"{_ROTARY_PARAMETERS}; left unpatched")
    rotary = next((m for m in model.modules() if type(m) is family.rotary), None)
    attention = next((m for m in model.modules() if type(m) is family.attention), None)
    if rotary is None or attention is None:
        return f"{family.spec.model_type}: no {family.spec.rotary_class}/{family.spec.attention_class} module"
    probe = torch.zeros(1, device=rotary.inv_freq.device, dtype=torch.float32)
    positions = torch.arange(8, device=probe.device)[None]
    with torch.no_grad():
        cos, sin = rotary(probe, positions)
    head_dim, half = getattr(attention, "head_dim", -1), cos.shape[-1] // 2
    if cos.shape[-1] != head_dim:
        return f"rotary: cos/sin width {cos.shape[-1]} != head_dim {head_dim} (partial rotary layout unknown)"
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        return "rotary: cos/sin are not cat(freqs, freqs) (not the NeoX layout plait's hook assumes)"
    return ""


def _plan(model: torch.nn.Module, config: PatchConfig, family: ResolvedFamily):
    """Decide every module to patch, without modifying anything."""
    name = family.spec.model_type
    skipped: list[str] = []
    norm_targets, mlp_targets, attn_targets, gate_targets = [], [], [], []
    kind, reason = _activation_kind(model, name)
    for module in model.modules():
        cls = type(module)
        if forwards.is_installed(module):
            raise RuntimeError(f"{cls.__name__} is already patched by plait but the model has no patch state; "
                               "it was patched through another model object sharing this module.")
        if config.rms_norm and cls is family.rms_norm:
            norm_targets.append(module)
        elif config.mlp and kind is not None and cls in family.mlps:
            mlp_targets.append(module)
        elif config.rotary and cls is family.attention:
            attn_targets.append(module)
        elif config.experts and kind is not None and family.experts is not None and cls is family.experts:
            gate_targets.append(module)
    if reason and (config.mlp and family.mlps or config.experts and family.experts is not None):
        skipped.append(reason)
    if attn_targets:
        rotary_reason = _rotary_layout_ok(model, family)
        if rotary_reason:
            skipped.append(rotary_reason)
            attn_targets = []
    if gate_targets:
        implementation = getattr(model.config, "_experts_implementation", None)
        if implementation not in ("grouped_mm", "batched_mm"):
            skipped.append(
                f"experts: experts_implementation={implementation!r} computes act(gate)*up inline; "
                "set model.set_experts_implementation('grouped_mm') (or 'batched_mm') to use silu_and_mul"
            )
            gate_targets = []
    return norm_targets, mlp_targets, attn_targets, gate_targets, kind, tuple(skipped)


def _kept_for_speed(model: torch.nn.Module, config: PatchConfig, targets: dict[str, list]) -> tuple[str, ...]:
    """Under ``policy="auto"``, the parts to leave to the model's code on this device, with why."""
    if config.policy != "auto" or not any(targets.values()):
        return ()
    probe = next(model.parameters(), None)
    if probe is None or select_backend(probe) == "triton":
        return ()
    return tuple(f"{part}: kept the model's own code for {len(modules)} module(s): on {probe.device.type} plait's "
                 "op runs its torch reference, which is not faster (PatchConfig(policy='always') patches anyway)"
                 for part, modules in targets.items() if modules)


def apply(model: torch.nn.Module, config: PatchConfig | None = None) -> PatchReport:
    """Patch ``model`` in place with plait's kernels.

    Args:
        model: a transformers model of a supported family (``model.config.model_type``).
        config: what to patch (default: everything).

    Returns:
        The :class:`PatchReport` (the existing one if the model is already patched with ``config``).

    Raises:
        UnsupportedTransformersError: transformers missing or outside the supported range.
        UnsupportedModelError: the family has no mapping (message lists the supported ones) or
            its modeling module lacks what the patch needs.
        ValueError: already patched with a different config (revert first), or a bad config.
    """
    config = PatchConfig() if config is None else config
    if not isinstance(config, PatchConfig):
        raise ValueError(f"config={config!r} must be a PatchConfig.")
    existing = patch_report(model)
    if existing is not None:
        if existing.config == config:
            return existing
        raise ValueError(
            f"model is already patched with {existing.config}; call revert(model) before applying {config}."
        )
    version = check_transformers_version()
    family = resolve(family_of(model))
    norms, mlps, attns, gates, kind, skipped = _plan(model, config, family)
    kept = _kept_for_speed(model, config, {"rms_norm": norms, "mlp": mlps, "attention_rotary": attns,
                                            "experts_gate": gates})
    if kept:
        norms, mlps, attns, gates = [], [], [], []
    state = _State(
        report=PatchReport(
            family=family.spec.model_type, transformers_version=version, config=config,
            patched={"rms_norm": len(norms), "mlp": len(mlps), "attention_rotary": len(attns),
                     "experts_gate": len(gates)},
            skipped=skipped, kept=kept,
        ),
        family=family, forwards=[], gates=[], rotary_hooked=False,
    )
    model.__dict__[_STATE] = state
    try:
        for module in norms:
            forwards.install_forward(module, forwards.rms_norm_forward)
            state.forwards.append(module)
        if mlps:
            mlp_forward = forwards.make_gated_mlp_forward(kind)
            for module in mlps:
                forwards.install_forward(module, mlp_forward)
                state.forwards.append(module)
        if attns:
            forwards.acquire_rotary_hook(family.module, state)
            state.rotary_hooked = True
            for module in attns:
                forwards.install_forward(module, forwards.attention_forward)
                state.forwards.append(module)
        if gates:
            gate = forwards.make_experts_gate(kind)
            for module in gates:
                module.__dict__["_plait_prior_apply_gate"] = module.__dict__.get("_apply_gate")
                module._apply_gate = gate.__get__(module)
                state.gates.append(module)
    except BaseException:
        revert(model)
        raise
    return state.report


def revert(model: torch.nn.Module) -> bool:
    """Undo :func:`apply` exactly: every patched instance gets back its own attributes.

    Args:
        model: a model patched by :func:`apply` (anything else is left alone).

    Returns:
        True if a patch was removed, False if the model was not patched.
    """
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return False
    for module in state.forwards:
        forwards.uninstall_forward(module)
    for module in state.gates:
        prior = module.__dict__.pop("_plait_prior_apply_gate", None)
        module.__dict__.pop("_apply_gate", None)
        if prior is not None:
            module._apply_gate = prior
    if state.rotary_hooked:
        forwards.release_rotary_hook(state.family.module, state)
    return True


@contextlib.contextmanager
def patched(model: torch.nn.Module, config: PatchConfig | None = None) -> Iterator[PatchReport]:
    """Context manager: :func:`apply` on entry, :func:`revert` on exit (if this call applied it).

    Args:
        model: as for :func:`apply`.
        config: as for :func:`apply`.

    Yields:
        The :class:`PatchReport`.

    Raises:
        As :func:`apply`.
    """
    was_patched = is_patched(model)
    report = apply(model, config)
    try:
        yield report
    finally:
        if not was_patched:
            revert(model)
