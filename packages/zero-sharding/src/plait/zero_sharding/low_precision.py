"""Master weights and optimizer state below fp32, around an unmodified inner optimizer.

:class:`LowPrecisionOptimizer` wraps a ``torch.optim`` optimizer (AdamW, SGD...) built over the
tensors it updates: under ZeRO those are the flat master shards, in one process the parameters.
Between steps each state the inner optimizer keeps per element is stored compactly (bf16, or int8
codes with one fp32 scale per block, see :mod:`plait.zero_sharding.state_quant`), and a bf16
master carries either a bf16 compensation buffer or nothing (stochastic rounding). At the step,
one tensor at a time: its states are expanded to fp32, the master widened to fp32 (plus its
compensation), the inner optimizer steps that tensor alone, and everything is written back
compactly. Transient memory is one tensor's fp32 master and states; torch's optimizer code is
used as it is.

Every operation is elementwise or per block, and stochastic rounding's noise is keyed by each
element's parameter name and index: a ZeRO run at any world size equals one process running the
same wrapper bit for bit, provided the int8 blocks are the same (blocks are consecutive elements of
each tensor the wrapper sees; ZeRO pads every shard to whole blocks, so with one parameter per unit
the blocks are the parameter's own).

``ZeroConfig(master_dtype=..., master_rounding=..., optimizer_state_dtype=..., state_block_size=...)``
switches it on in :func:`plait.zero_sharding.zero_shard`; a parameter group's ``zero_state_dtype``
overrides the state dtype for its tensors, and its ``zero_master_dtype`` the master dtype (a bf16
master is the group's bf16 compute shard, rounded as ``ZeroConfig.master_rounding`` says:
compensated unless the config asks for stochastic rounding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from plait.zero_sharding.config import ZeroConfig, state_dtype_name
from plait.zero_sharding.state_quant import (
    dequantize_blockwise,
    element_noise,
    int8_bytes,
    quantize_blockwise,
    stochastic_round_bf16,
)

# Optimizer class name -> the per-element states it keeps ("signed" or "unsigned" values), which
# are the ones stored below fp32. int8 is offered for the Adam family only (the map was chosen for
# its moments); bf16 for every optimizer listed.
STATE_KINDS: dict[str, dict[str, str]] = {
    "Adam": {"exp_avg": "signed", "exp_avg_sq": "unsigned", "max_exp_avg_sq": "unsigned"},
    "AdamW": {"exp_avg": "signed", "exp_avg_sq": "unsigned", "max_exp_avg_sq": "unsigned"},
    "SGD": {"momentum_buffer": "signed"},
    "RMSprop": {"square_avg": "unsigned", "momentum_buffer": "signed", "grad_avg": "signed"},
    "Adagrad": {"sum": "unsigned"},
}
INT8_OPTIMIZERS = ("Adam", "AdamW")
COMPENSATION = "master_compensation"  # bf16 residual of a compensated bf16 master, in its state


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorPrecision:
    """How one tensor's master and states are stored between steps.

    Attributes:
        state_dtype: ``"fp32"``, ``"bf16"`` or ``"int8"`` for the states of :data:`STATE_KINDS`.
        master_rounding: for a bf16 tensor: ``"compensated"`` or ``"stochastic"``; ignored for fp32.
        block_size: elements per int8 block.
        seed: stochastic rounding's seed.
    """

    state_dtype: str = "fp32"
    master_rounding: str = "compensated"
    block_size: int = 256
    seed: int = 0


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """An inner optimizer whose masters and states are kept below fp32 (see the module docstring).

    Its ``param_groups`` and ``state`` are the inner optimizer's (state holds the compact
    tensors between steps), so LR schedulers and ``state_dict()`` work unchanged; the saved
    state is the compact one, restored exactly by ``load_state_dict``.

    Args:
        inner: the optimizer over the tensors to update, without state yet.
        precision: one :class:`TensorPrecision` for all tensors, or a mapping tensor -> its own.
        pieces: tensor -> ``[(parameter name, first index in it, length, offset in the tensor)]``,
            the identity of its elements for stochastic rounding (default: each tensor is a whole
            parameter named by its index in the groups); ``names`` is the short form.
        names: tensor -> parameter name (each tensor a whole parameter).

    Raises:
        ValueError: a state dtype the inner optimizer cannot take (naming both), or a tensor
            that is neither fp32 nor bf16.
    """

    def __init__(self, inner: torch.optim.Optimizer, precision: TensorPrecision | Mapping[Tensor, TensorPrecision], *,
                 pieces: Mapping[Tensor, Sequence[tuple[str, int, int, int]]] | None = None,
                 names: Mapping[Tensor, str] | None = None) -> None:
        if inner.state:
            raise ValueError(f"LowPrecisionOptimizer(inner={type(inner).__name__}): the inner optimizer already has "
                             "state; wrap it before the first step.")
        super().__init__([torch.zeros(1, requires_grad=True)], dict(inner.defaults))
        self.inner = inner
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.steps_taken = 0
        params = [p for g in inner.param_groups for p in g["params"]]
        self._precision = {p: precision if isinstance(precision, TensorPrecision) else precision[p] for p in params}
        self._pieces = {p: list(pieces[p]) if pieces is not None else
                        [(names[p] if names is not None else f"param{i}", 0, p.numel(), 0)]
                        for i, p in enumerate(params)}
        self._kinds = STATE_KINDS.get(type(inner).__name__, {})
        for p in params:
            check_state_dtype(type(inner), self._precision[p].state_dtype, field="optimizer_state_dtype")
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"LowPrecisionOptimizer: a tensor of dtype {p.dtype}; masters must be fp32 or bf16.")

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Step every tensor that has a gradient, one at a time (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        grads = {p: p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = None
        self.steps_taken += 1
        try:
            for p, grad in grads.items():
                self._step_one(p, grad)
        finally:
            for p, grad in grads.items():
                p.grad = grad
        return loss

    def _step_one(self, p: Tensor, grad: Tensor) -> None:
        precision, state = self._precision[p], self.inner.state[p]
        stored = p.data
        low = stored.dtype == torch.bfloat16
        if low:
            work = stored.float()
            if precision.master_rounding == "compensated" and COMPENSATION in state:
                work.add_(state[COMPENSATION].float())
            p.data = work
        self._expand(p, state, precision)
        p.grad = grad.float() if grad.dtype != torch.float32 else grad
        try:
            self.inner.step()
        finally:
            p.grad = None
            if low:
                new, p.data = p.data, stored
        if low:
            self._store_master(p, stored, new, state, precision)
        self._compact(state, precision)

    def _store_master(self, p: Tensor, stored: Tensor, new: Tensor, state: dict[str, Any],
                      precision: TensorPrecision) -> None:
        """Write the fp32 result ``new`` into the bf16 master ``stored``."""
        if precision.master_rounding == "stochastic":
            noise = element_noise(new.numel(), self._pieces[p], seed=precision.seed, step=self.steps_taken,
                                  device=new.device)
            stored.copy_(stochastic_round_bf16(new, noise))
            return
        stored.copy_(new)  # round to nearest; the residual is kept below
        state[COMPENSATION] = (new - stored.float()).to(torch.bfloat16)

    def _expand(self, p: Tensor, state: dict[str, Any], precision: TensorPrecision) -> None:
        """Compact states -> fp32, in place in the state dict (the inner optimizer's view)."""
        for key, kind in self._kinds.items():
            value = state.get(key)
            if not isinstance(value, Tensor):
                continue
            if value.dtype == torch.uint8:
                state[key] = dequantize_blockwise(value, state.pop(f"{key}.absmax"), kind, precision.block_size)
            elif value.dtype != torch.float32:
                state[key] = value.float()

    def _compact(self, state: dict[str, Any], precision: TensorPrecision) -> None:
        """fp32 states -> their stored dtype."""
        for key, kind in self._kinds.items():
            value = state.get(key)
            if not isinstance(value, Tensor) or value.dtype != torch.float32:
                continue
            if precision.state_dtype == "bf16":
                state[key] = value.to(torch.bfloat16)
            elif precision.state_dtype == "int8":
                state[key], state[f"{key}.absmax"] = quantize_blockwise(value, kind, precision.block_size)

    # ---- state --------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the inner optimizer's gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict (compact states, compensation buffers) and the step
        count stochastic rounding keys its noise with."""
        return {"inner": self.inner.state_dict(), "steps_taken": self.steps_taken}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict` exactly. torch casts every state tensor to its parameter's
        dtype on load (int8 codes included), so each loaded state is cast back to the dtype it was
        saved in; the tensors are shown to torch as fp32 placeholders meanwhile, so that no fp32
        state of a bf16 master is rounded on the way (every cast here is then exact)."""
        saved = state_dict["inner"]
        params = [p for g in self.param_groups for p in g["params"]]
        by_id = {pid: p for group, mine in zip(saved["param_groups"], self.param_groups)
                 for pid, p in zip(group["params"], mine["params"])}
        stored = {p: p.data for p in params}
        for p in params:
            p.data = torch.zeros(1, dtype=torch.float32, device=p.device).expand(p.shape)
        try:
            self.inner.load_state_dict(saved)
        finally:
            for p in params:
                p.data = stored[p]
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.steps_taken = int(state_dict["steps_taken"])
        for pid, values in saved["state"].items():
            state = self.inner.state[by_id[pid]]
            for key, value in values.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = state[key].to(value.dtype)


def check_state_dtype(cls: Any, state_dtype: str, *, field: str) -> None:
    """Refuse a state dtype the optimizer cannot take, naming both.

    Raises:
        ValueError: bf16 for an optimizer outside :data:`STATE_KINDS`, int8 outside
            :data:`INT8_OPTIMIZERS`.
    """
    name = getattr(cls, "__name__", repr(cls))
    if state_dtype == "fp32":
        return
    allowed = INT8_OPTIMIZERS if state_dtype == "int8" else tuple(STATE_KINDS)
    if name not in allowed:
        raise ValueError(f"{field}={state_dtype!r} cannot be applied to optimizer {name}: plait stores {state_dtype} "
                         f"states only for {', '.join(allowed)} (it must know which states are per element and "
                         f"their sign). Use {field}='fp32' with {name}, or one of those optimizers.")


def block_multiple(config: ZeroConfig, group_state_dtype: str | None) -> int:
    """What a unit's shard length must be a multiple of: the int8 block, else 1."""
    dtype = group_state_dtype or config.optimizer_state_dtype
    return config.state_block_size if dtype == "int8" else 1


def group_master_dtype(index: int, value: Any, config: ZeroConfig) -> torch.dtype | None:
    """A parameter group's ``zero_master_dtype`` (``None``: not given, ``ZeroConfig.master_dtype``).

    Args:
        index: the group's index in ``param_groups`` (named in errors).
        value: the group's ``zero_master_dtype`` (``"fp32"``, ``"bf16"`` or the torch dtypes).
        config: the engine config (a bf16 master is the bf16 compute shard).

    Returns:
        ``torch.float32``, ``torch.bfloat16`` or ``None``.

    Raises:
        ValueError: naming the group and the field: an unknown dtype, or bf16 without
            ``compute_dtype='bf16'``.
    """
    if value is None:
        return None
    field = f"param_groups[{index}]['zero_master_dtype']"
    aliases = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    dtype = aliases.get(value.lower(), value) if isinstance(value, str) else value
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{field}={value!r} is not a supported master dtype; use 'fp32' or 'bf16'.")
    if dtype == torch.bfloat16 and config.compute_dtype != torch.bfloat16:
        raise ValueError(f"{field}='bf16' needs ZeroConfig(compute_dtype='bf16') (a bf16 master is the compute "
                         f"shard), got compute_dtype={config.compute_dtype}; set compute_dtype='bf16' or "
                         f"{field}='fp32'.")
    return dtype


def group_state_dtype(index: int, value: Any) -> str | None:
    """A parameter group's ``zero_state_dtype`` (``None``: not given).

    Raises:
        ValueError: naming the group and the accepted values.
    """
    return None if value is None else state_dtype_name(f"param_groups[{index}]['zero_state_dtype']", value)


def check_composes(cls: Any, config: ZeroConfig, group_dtypes: Sequence[str | None], *, placement: Any,
                   param_groups: Sequence[Any] | None, whole_tensor: bool,
                   group_masters: Sequence[torch.dtype | None] = ()) -> None:
    """Refuse low-precision settings that do not compose, before any work.

    Args:
        cls: the optimizer class.
        config: the engine config.
        group_dtypes: each parameter group's ``zero_state_dtype`` (``None``: not given).
        placement: ``zero_shard``'s ``placement``.
        param_groups: ``zero_shard``'s ``param_groups``.
        whole_tensor: the optimizer runs under the whole-tensor placement.
        group_masters: each parameter group's ``zero_master_dtype`` (``None``: not given).

    Raises:
        ValueError: a state dtype the optimizer cannot take (naming both), or low precision with a
            whole-tensor optimizer, a custom placement (offload) or an optimizer that brings its own
            exchange.
    """
    dtypes = {config.optimizer_state_dtype, *(d for d in group_dtypes if d is not None)}
    if not (config.low_precision_state or dtypes - {"fp32"} or torch.bfloat16 in group_masters):
        return
    name = getattr(cls, "__name__", repr(cls))
    for index, dtype in enumerate(group_dtypes):
        if dtype is not None:
            check_state_dtype(cls, dtype, field=f"param_groups[{index}]['zero_state_dtype']")
    check_state_dtype(cls, config.optimizer_state_dtype, field="ZeroConfig.optimizer_state_dtype")
    custom = placement is not None or any(isinstance(g, dict) and g.get("zero_placement") is not None
                                          for g in param_groups or [])
    why = ("is a whole-tensor optimizer (its state lives per whole tensor on an owner rank)" if whole_tensor else
           "brings its own gradient exchange" if callable(getattr(cls, "compose_with_zero", None)) else
           None)
    if why is not None:
        raise ValueError(f"optimizer {name} {why}; master_dtype / optimizer_state_dtype below fp32 apply to "
                         "elementwise optimizers on flat shards (AdamW, SGD...). Keep them at 'fp32' with it.")
    if custom:
        raise ValueError("master_dtype / optimizer_state_dtype below fp32 keep the state in the default placement; a "
                         "custom placement (placement=, a param group's zero_placement: CPU/NVMe offload) steps its "
                         "own state. Drop the placement or keep both settings at 'fp32'.")


def any_low_precision(config: ZeroConfig, groups: Sequence[Any]) -> bool:
    """Whether the config or an option group (its ``state_dtype`` / ``master_dtype``) keeps a
    master or a state below fp32."""
    return config.low_precision_state or any(g.state_dtype not in (None, "fp32") or g.master_dtype == torch.bfloat16
                                             for g in groups)


def state_precision_of(config: ZeroConfig, group_dtype: str | None) -> TensorPrecision:
    """The :class:`TensorPrecision` of a unit of a group (``group_dtype``: its ``zero_state_dtype``)."""
    return TensorPrecision(state_dtype=group_dtype or config.optimizer_state_dtype,
                           master_rounding=config.master_rounding or "compensated",
                           block_size=config.state_block_size, seed=config.stochastic_seed)


Builder = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def wrap_low_precision(build: Builder, config: ZeroConfig, groups: Sequence[Any], partition: Any) -> Builder:
    """``build`` (param groups over master shards -> the user's optimizer), wrapped in a
    :class:`LowPrecisionOptimizer` when the config or a group asks for state below fp32 (else
    ``build`` itself). Each master shard's elements are named by the parameter pieces it holds.

    Args:
        build: builds the user's optimizer.
        config: the engine config.
        groups: the option groups (their ``state_dtype`` and ``master_dtype``).
        partition: the units, whose ``master`` are the tensors the optimizer is built over.

    Returns:
        The builder to hand to the placement.
    """
    if not any_low_precision(config, groups):
        return build
    units = {id(unit.master): unit for unit in partition.units}

    def wrapped(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        inner = build(param_groups)
        masters = [p for g in inner.param_groups for p in g["params"]]
        for m in masters:  # a bf16 master shard takes the engine's fp32 averaged gradients
            if m.dtype == torch.bfloat16 and hasattr(m, "grad_dtype"):
                m.grad_dtype = None
        precision = {m: state_precision_of(config, groups[units[id(m)].option_index].state_dtype) for m in masters}
        pieces = {m: [(slot.global_name, slot.global_offset + plo, phi - plo, slo)
                      for slot, (plo, phi), (slo, _shi) in units[id(m)].local_pieces()] for m in masters}
        return LowPrecisionOptimizer(inner, precision, pieces=pieces)

    return wrapped


def refuse_sharded_state(optimizer: Any, what: str) -> None:
    """The sharded (universal) layout describes fp32 optimizer state; compact states are refused
    there rather than saved under a layout that would misread them.

    Raises:
        ValueError: ``optimizer`` runs a :class:`LowPrecisionOptimizer`.
    """
    if isinstance(getattr(optimizer, "inner", None), LowPrecisionOptimizer):
        raise ValueError(f"{what}: master_dtype / optimizer_state_dtype below fp32 keep compact optimizer state, which "
                         "the sharded checkpoint layout does not describe yet. Save model.state_dict() and "
                         "optimizer.state_dict() on every rank (exact, resumable at the same world size).")


def state_bytes_per_element(precision: TensorPrecision, kinds: Sequence[str], *, bf16_master: bool) -> float:
    """Bytes per element a rank keeps for masters' compensation and the optimizer states between
    steps (the compute shard and the gradient are counted by the ZeRO formula).

    Args:
        precision: the tensor's setting.
        kinds: the states the optimizer keeps per element (e.g. Adam's ``exp_avg``, ``exp_avg_sq``).
        bf16_master: the master is bf16 (compensation adds 2 bytes).

    Returns:
        Bytes per element (int8: codes plus the block scales, ``1 + 4 / block_size`` each).
    """
    per_state = {"fp32": 4.0, "bf16": 2.0, "int8": int8_bytes(precision.block_size, precision.block_size)
                 / precision.block_size}[precision.state_dtype]
    compensation = 2.0 if bf16_master and precision.master_rounding == "compensated" else 0.0
    return per_state * len(kinds) + compensation
