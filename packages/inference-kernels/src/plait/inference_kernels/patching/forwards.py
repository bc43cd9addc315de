"""The replacement forwards plait installs on HF module instances, and the rotary hook.

Every replacement is a plain function ``f(self, ...)`` bound to one module instance with
:class:`types.MethodType` and stored as that instance's ``forward`` attribute. The class and every
other instance stay untouched, and ``copy.deepcopy`` of a patched model rebinds the methods to the
copies. Whatever the instance had as ``forward`` before (normally nothing: the class method) is
kept under :data:`PRIOR_FORWARD` so revert restores it exactly and fallbacks can call it.

Rotary: HF attention calls the *module-level* function ``apply_rotary_pos_emb`` of its modeling
file; transformers has no per-instance hook for it (its ``use_kernelized_func`` hook needs the
``kernels`` package and the Hub). So plait puts one dispatcher into the modeling module's namespace
while at least one model of that family is patched, and each patched attention instance raises a
context flag around its forward. The dispatcher runs plait's rotary only under that flag and calls
the original function otherwise, so unpatched models of the same family compute exactly as before.
"""

from __future__ import annotations

import contextvars
import functools
import types
import weakref

import torch
import torch.nn.functional as F

from plait.kernels import dispatch
from plait.kernels.ops import (
    apply_rotary,
    gated_activation_reference,
    gelu_and_mul,
    rms_norm,
    rms_norm_reference,
    rotary_embedding,
    silu_and_mul,
)
from plait.kernels.ops.rotary import SUPPORTED_DTYPES, rotate_neox_in_place

PRIOR_FORWARD = "_plait_prior_forward"
"""Instance attribute holding the instance's ``forward`` from before the patch (or None)."""

_GATE_UP_CACHE = "_plait_gate_up_cache"
_ROTARY_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("plait_rotary_active", default=False)
_COMPILED_ROTARY_DEPTH = [0]
"""Patched attentions being traced by torch.compile: dynamo cannot trace ``ContextVar`` (a graph
break at every attention), but it traces a module-level list, folding the flag into the graph."""


def original_forward(module: torch.nn.Module):
    """The forward the module had before plait patched it (its own, or the class's)."""
    prior = module.__dict__.get(PRIOR_FORWARD)
    # functools.partial, not types.MethodType: torch.compile traces the former, breaks its graph on the latter.
    return prior if prior is not None else functools.partial(type(module).forward, module)


def install_forward(module: torch.nn.Module, replacement) -> None:
    """Bind ``replacement(self, ...)`` as ``module.forward``, remembering the previous one."""
    module.__dict__[PRIOR_FORWARD] = module.__dict__.get("forward")
    module.forward = types.MethodType(replacement, module)


def uninstall_forward(module: torch.nn.Module) -> None:
    """Undo :func:`install_forward` exactly (and drop any cache the patch kept on the module)."""
    prior = module.__dict__.pop(PRIOR_FORWARD, None)
    module.__dict__.pop("forward", None)
    module.__dict__.pop(_GATE_UP_CACHE, None)
    if prior is not None:
        module.forward = prior


def is_installed(module: torch.nn.Module) -> bool:
    """Whether :func:`install_forward` has patched ``module``."""
    return PRIOR_FORWARD in module.__dict__


# ---- RMSNorm ---------------------------------------------------------------------------------


def rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF ``*RMSNorm.forward`` through ``plait.kernels.ops.rms_norm``.

    HF returns ``weight * normed.to(input_dtype)``, which type-promotes when the weight's dtype
    differs from the input's; plait returns the input dtype. To keep outputs identical in kind,
    that mixed case (rare: fp32 norm weights in a bf16 model) runs the original forward.
    """
    if self.weight.dtype != hidden_states.dtype or hidden_states.dtype not in SUPPORTED_DTYPES:
        return original_forward(self)(hidden_states)
    if dispatch.select_backend(hidden_states, self.weight) == dispatch.REFERENCE:
        # The HF module guarantees what rms_norm's validation checks (weight [hidden], same device),
        # and on a CPU decode step that validation is a measurable share of the op; go straight
        # to the reference, which is exactly what rms_norm would run here.
        return rms_norm_reference(hidden_states, self.weight, self.variance_epsilon)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


# ---- gated MLP -------------------------------------------------------------------------------


def gated_op(kind: tuple[str, str | None]):
    """The plait op for an :data:`~plait.inference_kernels.patching.registry.ACTIVATION_KINDS` entry.

    On the reference backend the op's own reference is called directly: the fused GEMM output
    is ``[..., 2d]`` by construction, so the public op's validation would only add overhead.
    """
    name, approximate = kind
    public = silu_and_mul if name == "silu" else functools.partial(gelu_and_mul, approximate=approximate)
    activation = "silu" if name == "silu" else ("gelu" if approximate == "none" else "gelu_tanh")

    def op(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in SUPPORTED_DTYPES or dispatch.select_backend(x) == dispatch.REFERENCE:
            return gated_activation_reference(x, activation)  # float64 models keep float64 math
        return public(x)

    return op


def _fused(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return torch.cat((first, second), dim=0)


def fused_gate_up(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[W_gate; W_up]`` (and biases) for one GEMM, kept in sync with the original weights.

    While gradients flow to the weights (training) the concatenation is rebuilt on every call so
    autograd reaches the original parameters. Otherwise it is cached on the module and rebuilt
    whenever either weight is replaced, moved, cast or modified in place (tracked through the
    tensors' identity, storage address and in-place version counter), so it is never stale.
    """
    gate, up = module.gate_proj, module.up_proj
    tensors = [gate.weight, up.weight]
    if gate.bias is not None:
        tensors += [gate.bias, up.bias]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        bias = _fused(gate.bias, up.bias) if gate.bias is not None else None
        return _fused(gate.weight, up.weight), bias
    # data_ptr changes when a weight is replaced, moved or cast; _version when it is modified in place.
    key = tuple((t.data_ptr(), t._version) for t in tensors)
    cached = module.__dict__.get(_GATE_UP_CACHE)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            weight = _fused(gate.weight, up.weight)
            bias = _fused(gate.bias, up.bias) if gate.bias is not None else None
        cached = (key, weight, bias)
        module.__dict__[_GATE_UP_CACHE] = cached
    return cached[1], cached[2]


def make_gated_mlp_forward(kind: tuple[str, str | None]):
    """A replacement for HF ``*MLP.forward``: ``down(act_and_mul(x @ [W_gate; W_up]^T))``."""
    op = gated_op(kind)

    def gated_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight, bias = fused_gate_up(self)
        return self.down_proj(op(F.linear(x, weight, bias)))

    return gated_mlp_forward


def make_experts_gate(kind: tuple[str, str | None]):
    """A replacement for the experts' ``_apply_gate(gate_up_out)``: gate first, then up."""
    op = gated_op(kind)

    def apply_gate(self: torch.nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
        return op(gate_up_out)

    return apply_gate


# ---- rotary ----------------------------------------------------------------------------------


def attention_forward(self: torch.nn.Module, *args, **kwargs):
    """HF ``*Attention.forward`` unchanged, run with plait's rotary switched on for this call."""
    if torch.compiler.is_compiling():
        _COMPILED_ROTARY_DEPTH[0] += 1
        try:
            return original_forward(self)(*args, **kwargs)
        finally:
            _COMPILED_ROTARY_DEPTH[0] -= 1
    token = _ROTARY_ACTIVE.set(True)
    try:
        return original_forward(self)(*args, **kwargs)
    finally:
        _ROTARY_ACTIVE.reset(token)


def _rotary_active() -> bool:
    """Whether the current call runs inside a patched attention (see :func:`attention_forward`)."""
    if torch.compiler.is_compiling():
        return _COMPILED_ROTARY_DEPTH[0] > 0
    return _ROTARY_ACTIVE.get()


def _plait_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF-layout rotary via plait: q ``[b, hq, s, d]``, k ``[b, hk, s, d]``, cos/sin ``[b or 1, s, d]``.

    HF's cos/sin for these families are ``cat(freqs, freqs)`` (checked once at apply time), so
    their first halves are the ``(cos, sin)`` tables, one row per (batch, position) entry, and the
    "positions" are simply the row numbers.
    """
    head_size, half = q.shape[-1], q.shape[-1] // 2
    q_t, k_t = q.transpose(1, 2), k.transpose(1, 2)  # [b, s, heads, d]: the projections' own layout
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if not needs_grad and q.dtype == torch.float32 and dispatch.select_backend(q) == dispatch.REFERENCE:
        # CPU fp32 inference: HF's cos is already cos|cos, so the reference's in-place NeoX rotation
        # takes it as is (no position gather), with the sign folded into the sine table.
        cos_full = cos.unsqueeze(2)
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        rotate_neox_in_place(q_t, cos_full, sin_signed, head_size)
        rotate_neox_in_place(k_t, cos_full, sin_signed, head_size)
        return q, k
    rows_b, seq = cos.shape[0], cos.shape[1]
    cos_half = cos[..., :half].reshape(rows_b * seq, half)
    sin_half = sin[..., :half].reshape(rows_b * seq, half)
    positions = torch.arange(rows_b * seq, device=q.device).view(rows_b, seq)
    if rows_b != q.shape[0]:  # one position row shared by the whole batch
        positions = positions.expand(q.shape[0], seq)
    if needs_grad:
        q_out, k_out = rotary_embedding(q_t, k_t, (cos_half, sin_half), positions,
                                        head_size=head_size, validate_positions=False)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    apply_rotary(q_t, k_t, (cos_half, sin_half), positions, head_size=head_size, validate_positions=False)
    return q, k


def _hf_layout_ok(q, k, cos, sin, unsqueeze_dim) -> bool:
    # Anything else (a float64 model, a custom call) runs HF's own function unchanged.
    return (
        q.dtype in SUPPORTED_DTYPES and k.dtype == q.dtype and cos.dtype in SUPPORTED_DTYPES
        and unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
        and cos.shape[-1] == q.shape[-1] == k.shape[-1] and q.shape[-1] % 2 == 0
        and q.shape[2] == k.shape[2] == cos.shape[1] and cos.shape[0] in (1, q.shape[0]) and k.shape[0] == q.shape[0]
    )


class RotaryHook:
    """The dispatcher placed in a modeling module as ``apply_rotary_pos_emb`` while models are patched.

    Args:
        module: the HF modeling module.
    """

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.original = module.apply_rotary_pos_emb
        self.users: weakref.WeakSet = weakref.WeakSet()
        functools.update_wrapper(self, self.original)

    def __call__(self, q, k, cos, sin, unsqueeze_dim: int = 1, **kwargs):
        """Plait's rotary inside a patched attention (HF layout only), the original otherwise."""
        if _rotary_active() and not kwargs and _hf_layout_ok(q, k, cos, sin, unsqueeze_dim):
            return _plait_rotary(q, k, cos, sin)
        return self.original(q, k, cos, sin, unsqueeze_dim, **kwargs)


_HOOKS: dict[str, RotaryHook] = {}


def acquire_rotary_hook(module: types.ModuleType, user: object) -> None:
    """Install the dispatcher in ``module`` (once) and count ``user`` (a model's patch state) as a user.

    Users are held weakly: a patched model that is garbage-collected without ``revert`` stops
    counting, and the dispatcher itself never changes results for unpatched models.
    """
    hook = _HOOKS.get(module.__name__)
    if hook is None or module.apply_rotary_pos_emb is not hook:
        hook = RotaryHook(module)
        _HOOKS[module.__name__] = hook
        module.apply_rotary_pos_emb = hook
    hook.users.add(user)


def release_rotary_hook(module: types.ModuleType, user: object) -> None:
    """Drop ``user`` from the users; put the original function back when none is left."""
    hook = _HOOKS.get(module.__name__)
    if hook is None:
        return
    hook.users.discard(user)
    if not hook.users:
        if module.apply_rotary_pos_emb is hook:
            module.apply_rotary_pos_emb = hook.original
        del _HOOKS[module.__name__]


def rotary_hook_installed(module: types.ModuleType) -> bool:
    """Whether plait's dispatcher is currently ``module.apply_rotary_pos_emb``."""
    return isinstance(module.apply_rotary_pos_emb, RotaryHook)
