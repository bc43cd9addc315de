"""ZeroModule: the class a sharded model becomes (``fully_shard`` style: a dynamic subclass).

The subclass keeps the base class's name and qualified name: libraries read
``model.__class__.__name__`` as the architecture (HF ``save_pretrained`` writes it into
``config.json``'s ``architectures``, which vLLM and ``from_pretrained`` resolve), so a sharded
``LlamaForCausalLM`` must still be called that. ``isinstance(model, ZeroModule)`` tells a sharded
model apart, and :attr:`ZeroModule.zero_base_class` gives the class it was built as.

It adds the engine-facing methods next to the model's own: ``no_sync()``,
``set_requires_gradient_sync()``, ``gathered_parameters()``, full-tensor ``state_dict`` /
``load_state_dict``, the sharded-state protocol, ``export_full_weights`` and ``model_state_bytes``.
The model's ``forward`` is untouched.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from plait.kernels.sharded_state import ShardedTensor
from plait.kernels.state_names import tied_aliases, with_aliases
from plait.zero_sharding import checkpoint
from plait.zero_sharding.loss_scaler import ScaleGrad

_classes: dict[type, type] = {}


class ZeroModule:
    """Mixin of a sharded model (see the module docstring). Attributes set by ``zero_shard``:
    ``zero_engine`` and ``zero_optimizer``."""

    zero_engine: Any
    zero_optimizer: Any
    zero_base_class: type  # the model's class before sharding (set on each dynamic subclass)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        return self.zero_engine.no_sync()

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """``False``: later backward passes accumulate locally (as inside :meth:`no_sync`)."""
        self.zero_engine.require_sync = bool(requires)

    def gathered_parameters(self, *, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """See :func:`plait.zero_sharding.gathered_parameters`."""
        return self.zero_engine.gathered(writeback)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every gradient, exactly as ``optimizer.zero_grad()`` does (the HF Trainer calls
        only this one). ``nn.Module.zero_grad`` would drop ``param.grad`` alone and leave the reduced
        shards and stage 1's gradient buffer behind, so the next step would add stale gradients.

        Args:
            set_to_none: accepted for signature compatibility; reduced shards are always dropped.
        """
        self.zero_optimizer.zero_grad(set_to_none)

    def persistent_buffer_names(self) -> set[str]:
        """Names of buffers that belong in a state dict."""
        out = set()
        for prefix, module in self.named_modules():  # type: ignore[attr-defined]
            for name in module._buffers:
                if name not in module._non_persistent_buffers_set and module._buffers[name] is not None:
                    out.add(f"{prefix}.{name}" if prefix else name)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Whole parameters (fp32 masters cast to each parameter's dtype) and persistent buffers,
        the same on every rank. Parameters that live on some ranks only (experts under expert
        parallelism, given an identity by ``zero_global``) are whole global tensors under their
        global names, every rank's part included, so the dict is the whole model (as
        :meth:`export_full_weights` writes it). A tensor the model ties under several names (a head
        sharing the embedding's weight) appears under every name, as in ``nn.Module.state_dict``, so
        ``load_state_dict(strict=True)`` of an unsharded copy takes it. Collective: every rank must call it.

        Raises:
            ValueError: identities given by ``zero_global`` collide or leave a tensor uncovered.
        """
        out: dict[str, torch.Tensor] = OrderedDict()
        for name, value in checkpoint.iter_full_parameters(self.zero_engine, parameter_dtype=True):
            out[name] = value
        for name, buf in self.named_buffers():  # type: ignore[attr-defined]
            if name in self.persistent_buffer_names():
                out[name] = buf.detach().clone()
        return with_aliases(out, tied_aliases(self))  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:  # type: ignore[override]
        """Load whole tensors (each rank keeps its slices). Parameters that live on some ranks only
        are taken by their global names (as :meth:`export_full_weights` writes them); a model
        with such parameters exchanges the list of global names once (collective), so a key that
        is another rank's expert is not reported as unexpected. Every name of a tied tensor is
        accepted (``nn.Module.state_dict`` writes them all).

        Raises:
            KeyError: ``strict`` and parameters or buffers are missing, or keys are unexpected.
        """
        engine = self.zero_engine
        aliases = tied_aliases(self)  # type: ignore[arg-type]
        # A tied tensor is one parameter: it loads from its first name (or, without it, from an alias);
        # its further names are the same values in any dict the model's own state_dict() wrote.
        state_dict = dict(state_dict)
        for alias, canonical in aliases.items():
            if alias in state_dict and canonical not in state_dict:
                state_dict[canonical] = state_dict[alias]
            state_dict.pop(alias, None)
        names = {n for u in engine.units for s in u.slots for n in (s.name, s.global_name)}
        world = dist.get_world_size() if dist.is_initialized() else 1
        if any(checkpoint.spread(u, world) for u in engine.units):  # the same answer on every rank
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, sorted(names))  # names only, once per load
            names = {n for theirs in everyone for n in theirs}
        buffers = self.persistent_buffer_names()
        unexpected = sorted(k for k in state_dict if k not in names and k not in buffers)
        if strict and unexpected:
            raise KeyError(f"load_state_dict: unexpected keys {unexpected[:5]}; pass strict=False to ignore them.")
        missing = checkpoint.load_full_parameters(engine, state_dict, strict=strict)
        with torch.no_grad():
            for name, buf in self.named_buffers():  # type: ignore[attr-defined]
                if name in buffers:
                    if name in state_dict:
                        buf.copy_(state_dict[name])
                    elif strict:
                        raise KeyError(f"load_state_dict: missing buffer {name!r}; pass strict=False to keep it.")
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """The :class:`~plait.kernels.sharded_state.ShardedStateful` view (see :mod:`.checkpoint`)."""
        return checkpoint.sharded_state_dict(self.zero_engine, self.zero_optimizer)

    def checkpoint_aliases(self) -> dict[str, str]:
        """Tied names in :meth:`sharded_state_dict`'s naming, ``{"model.<alias>": "model.<name>"}``.

        The sharded view holds a tied tensor once; a checkpoint writer records these pairs
        (plait.universal_ckpt does) so that consolidated exports carry every name.

        Returns:
            ``{alias: canonical}``; empty for a model without tied tensors.
        """
        return tied_aliases(self, prefix="model.")  # type: ignore[arg-type]

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """Accept pieces filled in place (refreshes parameters from masters)."""
        checkpoint.load_sharded_state_dict(self.zero_engine, self.zero_optimizer, state)

    def export_full_weights(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path | None:
        """See :func:`plait.zero_sharding.checkpoint.export_full_weights`."""
        return checkpoint.export_full_weights(self, path, dtype=dtype)


def _scale_outputs(out: Any, scaler: Any) -> Any:
    """Route output gradients through :class:`ScaleGrad` (fp16 loss scaling without user code)."""
    def scale(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
            return ScaleGrad.apply(x, scaler)
        if hasattr(x, "__dataclass_fields__") and not isinstance(x, type):
            for name in x.__dataclass_fields__:
                setattr(x, name, scale(getattr(x, name)))
        return x
    return pytree.tree_map(scale, out)


def install(model: nn.Module, engine: Any, optimizer: Any) -> None:
    """Turn ``model`` into a ZeroModule subclass instance and attach engine and optimizer."""
    base = type(model)
    if base not in _classes:
        _classes[base] = type(base.__name__, (ZeroModule, base), {
            "__module__": base.__module__, "__qualname__": base.__qualname__, "zero_base_class": base})
    model.__class__ = _classes[base]
    model.zero_engine = engine
    model.zero_optimizer = optimizer
    if optimizer.scaler.enabled:
        scaler = optimizer.scaler
        engine.handles.append(model.register_forward_hook(
            lambda m, args, out: _scale_outputs(out, scaler) if torch.is_grad_enabled() else out))
