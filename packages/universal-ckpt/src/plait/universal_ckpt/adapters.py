"""Adapters: every kind of value a user puts in the state dict, seen through one interface.

A ShardedStateful producer already describes itself. Plain modules (DDP included), torch
optimizers and bare tensors are described as full pieces replicated on every rank, so the lowest
rank writes them once and any layout can read them. Objects with ``state_dict``/``load_state_dict``
(LR scheduler, loss scaler, data loader position, :class:`RNGState`) and plain values (the user's
``extra``) travel as pickled per-rank objects.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.kernels.sharded_state import ShardedStateful, ShardedTensor, ShardSpec
from plait.universal_ckpt.errors import CheckpointLayoutError
from plait.universal_ckpt.manifest import TensorEntry

NO_OBJECT = object()


class Adapter:
    """Base adapter: no tensors, no object. Subclasses override what they carry."""

    def __init__(self, key: str) -> None:
        self.key = key

    def tensors_for_save(self, gather: Callable[[Any], list[Any]] | None = None) -> dict[str, ShardedTensor]:
        """Pieces to write (locals may alias live storage; the saver snapshots as needed).

        Args:
            gather: the save's all-gather of a picklable value (every saving rank calls this
                method, so a producer may exchange what its pieces need); None outside a save.
        """
        return {}

    def tensors_for_load(self, saved: dict[str, TensorEntry]) -> dict[str, ShardedTensor]:
        """Pieces to fill, given the saved entries of this key."""
        return {}

    def object_for_save(self) -> Any:
        """A picklable snapshot of the non-tensor state, or NO_OBJECT."""
        return NO_OBJECT

    def finish_load(self, tensors: dict[str, ShardedTensor], obj: Any) -> None:
        """Called after ``tensors`` were filled in place; ``obj`` is the loaded object (or NO_OBJECT)."""


class ShardedAdapter(Adapter):
    """A :class:`ShardedStateful` producer (ZeRO engine, MoE layer, the tests' toy)."""

    def __init__(self, key: str, producer: ShardedStateful) -> None:
        super().__init__(key)
        self.producer = producer

    def tensors_for_save(self, gather: Callable[[Any], list[Any]] | None = None) -> dict[str, ShardedTensor]:
        # Optional producer hook: pieces that need the other ranks' values (averaged replicas).
        for_save = getattr(self.producer, "save_sharded_state_dict", None)
        if for_save is not None and gather is not None:
            return for_save(gather)
        return self.producer.sharded_state_dict()

    def tensors_for_load(self, saved: dict[str, TensorEntry]) -> dict[str, ShardedTensor]:
        # Optional producer hook: allocate state the checkpoint holds and a fresh target lacks
        # (a torch optimizer's lazily created moments).
        prepare = getattr(self.producer, "prepare_load", None)
        if prepare is not None:
            prepare(saved)
        return self.producer.sharded_state_dict()

    def finish_load(self, tensors: dict[str, ShardedTensor], obj: Any) -> None:
        self.producer.load_sharded_state_dict(tensors)


def _full(name: str, tensor: torch.Tensor, kind: str, replicas: tuple[int, ...],
          copy_back: list | None = None) -> ShardedTensor:
    """A whole tensor as one flat piece. A non-contiguous tensor cannot be viewed flat, so its
    piece is a copy; ``copy_back`` then collects ``(tensor, piece)`` to write back after a load."""
    local = tensor.detach().reshape(-1)
    if copy_back is not None and not tensor.is_contiguous():
        copy_back.append((tensor, local))
    return ShardedTensor(ShardSpec.full(name, tensor, kind=kind, replica_ranks=replicas), local)


def _write_back(copy_back: list) -> None:
    with torch.no_grad():
        for tensor, local in copy_back:
            tensor.copy_(local.view(tensor.shape))


class ModuleAdapter(Adapter):
    """A plain ``nn.Module`` (DDP unwrapped): its state dict as full replicated pieces."""

    def __init__(self, key: str, module: nn.Module, replicas: tuple[int, ...]) -> None:
        super().__init__(key)
        self.module = getattr(module, "module", module) if _is_ddp(module) else module
        self.replicas = replicas

    def _described(self, copy_back: list | None = None) -> dict[str, ShardedTensor]:
        params = {name for name, _ in self.module.named_parameters()}
        return {name: _full(name, tensor, "parameter" if name in params else "buffer", self.replicas, copy_back)
                for name, tensor in self.module.state_dict().items()}

    def tensors_for_save(self, gather: Callable[[Any], list[Any]] | None = None) -> dict[str, ShardedTensor]:
        return self._described()

    def tensors_for_load(self, saved: dict[str, TensorEntry]) -> dict[str, ShardedTensor]:
        self._copy_back: list = []
        return self._described(self._copy_back)

    def finish_load(self, tensors: dict[str, ShardedTensor], obj: Any) -> None:
        _write_back(getattr(self, "_copy_back", []))


def _is_ddp(module: nn.Module) -> bool:
    return isinstance(module, nn.parallel.DistributedDataParallel) or type(module).__name__ in (
        "DistributedDataParallel", "DataParallel")


class OptimizerAdapter(Adapter):
    """A ``torch.optim.Optimizer``: tensor state as ``state.<param index>.<field>`` full pieces,
    param groups and scalar state as the object. A fresh optimizer with no state yet gets its
    tensors allocated from the checkpoint, then ``load_state_dict`` builds its state."""

    def __init__(self, key: str, optimizer: torch.optim.Optimizer, replicas: tuple[int, ...]) -> None:
        super().__init__(key)
        self.optimizer = optimizer
        self.replicas = replicas

    def tensors_for_save(self, gather: Callable[[Any], list[Any]] | None = None) -> dict[str, ShardedTensor]:
        out = {}
        for index, fields in self.optimizer.state_dict()["state"].items():
            for field, value in fields.items():
                if isinstance(value, torch.Tensor):
                    name = f"state.{index}.{field}"
                    out[name] = _full(name, value, "optimizer_state", self.replicas)
        return out

    def object_for_save(self) -> Any:
        packed = self.optimizer.state_dict()
        scalars = {index: {f: v for f, v in fields.items() if not isinstance(v, torch.Tensor)}
                   for index, fields in packed["state"].items()}
        return {"param_groups": packed["param_groups"], "scalars": scalars}

    def tensors_for_load(self, saved: dict[str, TensorEntry]) -> dict[str, ShardedTensor]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        out = {}
        for name, entry in saved.items():
            _, index, field = name.split(".", 2)
            device = params[int(index)].device if int(index) < len(params) else torch.device("cpu")
            tensor = torch.empty(entry.global_shape, dtype=entry.torch_dtype, device=device)
            out[name] = _full(name, tensor, "optimizer_state", self.replicas)
        return out

    def finish_load(self, tensors: dict[str, ShardedTensor], obj: Any) -> None:
        if obj is NO_OBJECT:
            raise CheckpointLayoutError(f"checkpoint has no optimizer param groups for key {self.key!r}.")
        state: dict[int, dict[str, Any]] = {int(i): dict(fields) for i, fields in obj["scalars"].items()}
        for name, piece in tensors.items():
            _, index, field = name.split(".", 2)
            state.setdefault(int(index), {})[field] = piece.local.reshape(piece.spec.global_shape)
        self.optimizer.load_state_dict({"state": state, "param_groups": obj["param_groups"]})


class TensorAdapter(Adapter):
    """A bare tensor value, saved whole as ``<key>/tensor`` and loaded in place."""

    def __init__(self, key: str, tensor: torch.Tensor, replicas: tuple[int, ...]) -> None:
        super().__init__(key)
        self.tensor = tensor
        self.replicas = replicas

    def tensors_for_save(self, gather: Callable[[Any], list[Any]] | None = None) -> dict[str, ShardedTensor]:
        return {"tensor": _full("tensor", self.tensor, "other", self.replicas)}

    def tensors_for_load(self, saved: dict[str, TensorEntry]) -> dict[str, ShardedTensor]:
        self._copy_back: list = []
        return {"tensor": _full("tensor", self.tensor, "other", self.replicas, self._copy_back)}

    def finish_load(self, tensors: dict[str, ShardedTensor], obj: Any) -> None:
        _write_back(getattr(self, "_copy_back", []))


class StatefulAdapter(Adapter):
    """Anything with ``state_dict()``/``load_state_dict()`` (scheduler, scaler, loader, RNGState)."""

    def __init__(self, key: str, obj: Any) -> None:
        super().__init__(key)
        self.obj = obj

    def object_for_save(self) -> Any:
        return self.obj.state_dict()

    def finish_load(self, tensors: dict[str, ShardedTensor], obj: Any) -> None:
        if obj is not NO_OBJECT:
            self.obj.load_state_dict(obj)


class ValueAdapter(Adapter):
    """A plain picklable value (ints, dicts, the user's ``extra``); load replaces it in the dict."""

    def __init__(self, key: str, state: dict[str, Any]) -> None:
        super().__init__(key)
        self.state = state

    def object_for_save(self) -> Any:
        return self.state[self.key]

    def finish_load(self, tensors: dict[str, ShardedTensor], obj: Any) -> None:
        if obj is not NO_OBJECT:
            self.state[self.key] = obj


def adapt(state: dict[str, Any], replicas: tuple[int, ...]) -> list[Adapter]:
    """One adapter per key of ``state``, chosen by what the value is.

    Raises:
        ValueError: a key that is not a non-empty string without ``/``.
    """
    adapters: list[Adapter] = []
    for key, value in state.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"state key {key!r} must be a non-empty str without '/'; rename it.")
        if isinstance(value, ShardedStateful):
            adapters.append(ShardedAdapter(key, value))
        elif isinstance(value, nn.Module):
            adapters.append(ModuleAdapter(key, value, replicas))
        elif isinstance(value, torch.optim.Optimizer):
            adapters.append(OptimizerAdapter(key, value, replicas))
        elif isinstance(value, torch.Tensor):
            adapters.append(TensorAdapter(key, value, replicas))
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            adapters.append(StatefulAdapter(key, value))
        else:
            adapters.append(ValueAdapter(key, state))
    return adapters


class RNGState:
    """This rank's random number generators as a stateful: Python, NumPy, torch CPU and CUDA.

    Put one in the state dict (``{"rng": RNGState()}``); every rank saves its own, and on load rank
    r gets rank r's (ranks beyond the saved world size get rank 0's).
    """

    def state_dict(self) -> dict[str, Any]:
        """Snapshot every generator this process uses."""
        out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy as np

            out["numpy"] = np.random.get_state()
        except ImportError:
            pass
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the generators captured by :meth:`state_dict`."""
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
