"""Non-tensor state that cannot run code when it is read back.

A checkpoint's ``objects/rank-*`` files hold the non-tensor state of each rank (optimizer
param groups, LR scheduler and loss-scaler state, RNG states, data-loader positions, plain
values). A rank whose values are all plain (see :mod:`plait.universal_ckpt.object_json`) is
written as JSON, ``objects/rank-R.json``, and read without any unpickler. A rank holding a value
JSON cannot carry (a registered enum or dataclass, a numpy value) is written as
``objects/rank-R.pt`` with ``torch.save`` and read with torch's restricted unpickler
(``weights_only=True``) widened only by the types listed here, so a crafted file can build
containers, numbers, strings, tensors and the listed types, and nothing else: no function is
called, no other class is constructed.

The same list is checked when saving: a value the restricted reader would refuse is refused at
save time, naming its key path and type, so no checkpoint is written that its own loader cannot
read. ``save(..., allow_pickle=True)`` stores such a value anyway; the manifest records it and a
load then needs ``trust_pickled_objects=True`` (an unrestricted ``torch.load``, for files you
trust only).
"""

from __future__ import annotations

import argparse
import enum
import io
import pickle
from collections import OrderedDict
from typing import Any

import torch

from plait.universal_ckpt import object_json
from plait.universal_ckpt.errors import CheckpointFormatError, UnsafeObjectError

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)
_SEQUENCES = (list, tuple, set, frozenset)
_registered: list[type] = []


def register_safe_types(*types: type) -> None:
    """Allow more classes in checkpoint objects (your own enums and plain dataclasses).

    A registered class is constructed on load without running its ``__init__``; its fields are
    restored as data and checked like any other value. Register only classes whose
    construction has no side effects.

    Args:
        types: classes: ``enum.Enum`` subclasses, dataclasses, or ``argparse.Namespace``-like
            classes whose ``__dict__`` holds plain values.

    Raises:
        TypeError: something other than a class was given.
    """
    for cls in types:
        if not isinstance(cls, type):
            raise TypeError(f"register_safe_types takes classes; got {cls!r} ({type(cls).__name__}).")
        if cls not in _registered:
            _registered.append(cls)


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:  # numpy is optional: without it no numpy value can be in a checkpoint
        return []
    core = getattr(np, "_core", None) or np.core
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def allowed_globals() -> list[Any]:
    """Every global the restricted reader accepts beyond torch's own ``weights_only`` set.

    Returns:
        argparse.Namespace, frozenset, numpy's array/scalar/dtype reconstructors (when numpy is
        installed) and the classes given to :func:`register_safe_types`.
    """
    return [argparse.Namespace, frozenset, *_numpy_globals(), *_registered]


def _is_numpy_value(value: Any) -> bool:
    module = type(value).__module__
    if not module.startswith("numpy"):
        return False
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.dtype != object
    return isinstance(value, (np.generic, np.dtype))


def find_unsafe(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first value the restricted reader would refuse, as ``(key path, type name)``.

    Args:
        value: the object to check (usually ``{state key: object}``).
        path: the key path of ``value`` itself, used as the prefix of the answer.

    Returns:
        None when every value is allowed, else where the first refused one is and its type.
    """
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        cls = type(item)
        if isinstance(item, torch.Tensor):
            if cls not in (torch.Tensor, torch.nn.Parameter):
                return where or "<root>", f"{cls.__module__}.{cls.__qualname__}"
        elif cls in _PLAIN or _is_numpy_value(item):
            continue
        elif cls in _SEQUENCES:
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif cls in (dict, OrderedDict):
            for k, v in item.items():
                stack.append((k, f"{where}<key {k!r}>"))
                stack.append((v, f"{where}[{k!r}]"))
        elif cls in _registered and isinstance(item, enum.Enum):
            continue
        elif cls is argparse.Namespace or (cls in _registered and hasattr(item, "__dict__")
                                           and not hasattr(cls, "__slots__")):
            stack.extend((v, f"{where}.{k}") for k, v in vars(item).items())
        else:
            return where or "<root>", f"{cls.__module__}.{cls.__qualname__}"
    return None


def dump_objects(objects: dict[str, Any], *, allow_pickle: bool) -> bytes:
    """Serialise one rank's ``{key: object}``, refusing what the restricted reader cannot read.

    Args:
        objects: state key -> non-tensor state.
        allow_pickle: store values outside the allowlist anyway (the load must then trust them).

    Returns:
        The file's bytes.

    Raises:
        UnsafeObjectError: a value is outside the allowlist and ``allow_pickle`` is False.
    """
    found = None if allow_pickle else find_unsafe(objects)
    if found is not None:
        where, kind = found
        raise UnsafeObjectError(
            f"checkpoint object {where} is a {kind}, which plait does not store: a checkpoint holds only "
            "plain values, tensors, numpy arrays and the allowlisted types, so loading it cannot run code. "
            "Store its state_dict() / plain fields instead, register a plain class with "
            "plait.universal_ckpt.register_safe_types, or pass save(..., allow_pickle=True) (the load must "
            "then pass trust_pickled_objects=True).", key_path=where, type_name=kind)
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    data = buffer.getvalue()
    if not allow_pickle:
        load_objects(data, file="<being saved>", trusted=False)  # what is written must read back restricted
    return data


def encode_objects(objects: dict[str, Any], *, allow_pickle: bool) -> tuple[bytes, str]:
    """Serialise one rank's ``{key: object}``: JSON when every value is plain, else a pickle.

    Args:
        objects: state key -> non-tensor state.
        allow_pickle: store values outside the allowlist anyway (the load must then trust them).

    Returns:
        ``(file bytes, encoding)`` with encoding ``"json"`` or ``"pickle"``.

    Raises:
        UnsafeObjectError: a value is outside the allowlist and ``allow_pickle`` is False.
    """
    try:
        data = object_json.encode(objects)
    except object_json.NotEncodable:
        return dump_objects(objects, allow_pickle=allow_pickle), "pickle"
    object_json.decode(data, file="<being saved>")  # what is written must read back
    return data, "json"


def decode_objects(data: bytes, *, encoding: str, file: str, trusted: bool) -> Any:
    """Deserialise an object file written by :func:`encode_objects`.

    Args:
        data: the file's bytes.
        encoding: ``"json"`` (parsed, never unpickled, whatever ``trusted`` says) or ``"pickle"``.
        file: its name, for errors.
        trusted: for ``"pickle"``, run an unrestricted ``torch.load``.

    Returns:
        The stored ``{key: object}``.

    Raises:
        UnsafeObjectError: a pickle names a global outside the allowlist.
        CheckpointFormatError: the file is not readable in its encoding.
    """
    if encoding == "json":
        return object_json.decode(data, file=file)
    return load_objects(data, file=file, trusted=trusted)


def load_objects(data: bytes, *, file: str, trusted: bool) -> Any:
    """Deserialise an object file; restricted to the allowlist unless ``trusted``.

    Args:
        data: the file's bytes.
        file: its name, for the error.
        trusted: run an unrestricted ``torch.load`` (only for checkpoints you trust).

    Returns:
        The stored ``{key: object}``.

    Raises:
        UnsafeObjectError: the file names a global outside the allowlist (the message names it
            and the opt-in).
        CheckpointFormatError: the file is not a readable torch pickle.
    """
    if trusted:
        return torch.load(io.BytesIO(data), weights_only=False)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = str(exc)
        name = _refused_global(detail)
        raise UnsafeObjectError(
            f"checkpoint file {file} holds {name or 'a value'} outside plait's allowlist of safe types; it was "
            "not loaded, because unpickling it could run code. If you trust this checkpoint, pass "
            "trust_pickled_objects=True to the load.", key_path=file, type_name=name or "unknown") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointFormatError(f"checkpoint file {file} is not a readable object file: {exc}") from None


def _refused_global(detail: str) -> str | None:
    marker = "GLOBAL "
    start = detail.find(marker)
    if start < 0:
        return None
    return detail[start + len(marker):].split(" ", 1)[0]

