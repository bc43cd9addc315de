"""Non-tensor checkpoint state as JSON: plain values stored in a form that cannot run code.

A rank's objects (optimizer param groups, LR scheduler and loss-scaler state, RNG states,
data-loader positions, hyper-parameters) are written as ``objects/rank-R.json`` whenever every
value is encodable here. Reading such a file parses JSON and rebuilds containers, numbers,
strings and tensors from data: no unpickler runs, no class named by the file is constructed.

The file is ``{"format": "plait-objects", "version": 1, "objects": VALUE}``. JSON's own types
carry ``None``, ``bool``, ``int``, finite ``float``, ``str``, ``list`` and ``dict`` with string
keys. Everything JSON lacks is a JSON object with the reserved key ``"$plait"`` naming its kind:

=============  ==========================================================================
``$plait``     fields
=============  ==========================================================================
``float``      ``value``: ``"nan"``, ``"inf"`` or ``"-inf"`` (finite floats are plain JSON)
``complex``    ``real``, ``imag``: ``float.hex`` strings
``tuple``      ``items``: list (also ``set``, ``frozenset``)
``dict``       ``items``: list of ``[key, value]`` (a dict with a non-string key, or with the
               key ``"$plait"``); ``odict`` is the same for ``collections.OrderedDict``
``bytes``      ``base64``: the bytes (also ``bytearray``)
``dtype``      ``name``: e.g. ``"bfloat16"``; ``device``: ``name``; ``size``: ``items``
``namespace``  ``items``: ``{attribute: value}`` of an ``argparse.Namespace``
``tensor``     ``dtype``, ``shape``, ``base64`` (the elements' bytes, C order, little-endian),
               optional ``device`` (omitted for CPU), ``requires_grad``, ``parameter``
``ndarray``    ``dtype`` (numpy's ``dtype.str``, e.g. ``"<u4"``), ``shape``, ``base64``;
               ``npscalar`` is a numpy scalar (``dtype``, ``base64``). Numeric and bool only.
=============  ==========================================================================

Tensors among the objects are small (RNG states, scalars); the model's and optimizer's tensors
live in the data files. A value outside this list (a registered enum or dataclass, a numpy
object or structured array, a tensor subclass or a sparse tensor) is not encodable: :func:`encode` raises
:class:`NotEncodable` and the caller keeps the whole rank in the restricted-pickle format.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
from collections import OrderedDict
from typing import Any

import torch

from plait.universal_ckpt.errors import CheckpointFormatError

FORMAT = "plait-objects"
VERSION = 1
TAG = "$plait"
_LITTLE_ENDIAN = sys.byteorder == "little"


class NotEncodable(Exception):  # noqa: N818 - a signal to fall back, not an error shown to users
    """A value has no JSON encoding here; ``where`` is its key path, ``kind`` its type."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(f"{where or '<root>'}: {kind}")
        self.where, self.kind = where, kind


def encode(objects: dict[str, Any]) -> bytes:
    """The JSON file for one rank's ``{key: object}``.

    Args:
        objects: state key -> non-tensor state.

    Returns:
        UTF-8 JSON bytes.

    Raises:
        NotEncodable: a value has no JSON encoding (names its key path and type).
    """
    body = {"format": FORMAT, "version": VERSION, "objects": _enc(objects, "")}
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


def decode(data: bytes, *, file: str) -> Any:
    """Rebuild one rank's ``{key: object}`` from its JSON file; never unpickles.

    Args:
        data: the file's bytes.
        file: its name, for errors.

    Returns:
        The stored objects.

    Raises:
        CheckpointFormatError: not a plait objects JSON file, or a malformed value (names the
            file and the key path).
    """
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointFormatError(f"checkpoint file {file} is not a readable objects JSON file: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CheckpointFormatError(f"checkpoint file {file} is not a {FORMAT} version {VERSION} file.")
    try:
        return _dec(body.get("objects"), "")
    except RecursionError:
        raise CheckpointFormatError(f"checkpoint file {file}: values nested too deeply.") from None
    except _Malformed as exc:
        raise CheckpointFormatError(f"checkpoint file {file}: value at {exc.where or '<root>'} is malformed: "
                                    f"{exc.why}.") from None


def _refuse_constant(name: str) -> Any:
    # plain JSON has no NaN/Infinity; encode() writes them tagged, so a bare one is damage
    raise ValueError(f"bare {name} is not allowed")


def _tagged(kind: str, **fields: Any) -> dict[str, Any]:
    return {TAG: kind, **fields}


def _enc(value: Any, where: str) -> Any:
    cls = type(value)
    if value is None or cls in (bool, int, str):
        return value
    if cls is float:
        return value if math.isfinite(value) else _tagged("float", value=repr(value))
    if cls in (list, tuple, set, frozenset):
        items = [_enc(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if cls is list else _tagged(cls.__name__, items=items)
    if cls in (dict, OrderedDict):
        return _enc_dict(value, where)
    if isinstance(value, torch.Tensor):
        return _enc_tensor(value, where)
    return _enc_other(value, where)


def _enc_dict(value: dict, where: str) -> Any:
    plain = type(value) is dict and all(type(k) is str for k in value) and TAG not in value
    if plain:
        return {k: _enc(v, f"{where}[{k!r}]") for k, v in value.items()}
    items = [[_enc(k, f"{where}<key {k!r}>"), _enc(v, f"{where}[{k!r}]")] for k, v in value.items()]
    return _tagged("dict" if type(value) is dict else "odict", items=items)


def _enc_other(value: Any, where: str) -> Any:
    cls = type(value)
    if cls is complex:
        return _tagged("complex", real=value.real.hex(), imag=value.imag.hex())
    if cls in (bytes, bytearray):
        return _tagged(cls.__name__, base64=base64.b64encode(value).decode())
    if cls is torch.dtype:
        return _tagged("dtype", name=str(value).removeprefix("torch."))
    if cls is torch.device:
        return _tagged("device", name=str(value))
    if cls is torch.Size:
        return _tagged("size", items=list(value))
    if cls is argparse.Namespace:
        return _tagged("namespace", items={k: _enc(v, f"{where}.{k}") for k, v in vars(value).items()})
    if cls.__module__ == "numpy" and _LITTLE_ENDIAN:
        return _enc_numpy(value, where)
    raise NotEncodable(where, f"{cls.__module__}.{cls.__qualname__}")


def _enc_tensor(value: torch.Tensor, where: str) -> dict[str, Any]:
    cls = type(value)
    if cls not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided \
            or value.is_quantized or value.device.type == "meta" or not _LITTLE_ENDIAN:
        raise NotEncodable(where, f"{cls.__module__}.{cls.__qualname__} ({value.layout}, {value.device})")
    flat = value.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    fields: dict[str, Any] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                              "base64": base64.b64encode(raw).decode()}
    if value.device.type != "cpu":
        fields["device"] = str(value.device)
    if value.requires_grad:
        fields["requires_grad"] = True
    if cls is torch.nn.Parameter:
        fields["parameter"] = True
    return _tagged("tensor", **fields)


def _enc_numpy(value: Any, where: str) -> dict[str, Any]:
    import numpy as np

    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in _NUMPY_KINDS and not value.dtype.fields:
        raw = np.ascontiguousarray(value).tobytes()
        if isinstance(value, np.ndarray):
            return _tagged("ndarray", dtype=value.dtype.str, shape=list(value.shape),
                           base64=base64.b64encode(raw).decode())
        return _tagged("npscalar", dtype=value.dtype.str, base64=base64.b64encode(raw).decode())
    raise NotEncodable(where, f"{type(value).__module__}.{type(value).__qualname__}")


# numpy dtype kinds stored as raw bytes: bool, signed, unsigned, float, complex (never object 'O')
_NUMPY_KINDS = "biufc"


class _Malformed(Exception):  # noqa: N818 - internal, turned into CheckpointFormatError
    def __init__(self, where: str, why: str) -> None:
        super().__init__(why)
        self.where, self.why = where, why


def _dec(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [_dec(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value  # None, bool, int, float, str: JSON's own
    if TAG not in value:
        return {k: _dec(v, f"{where}[{k!r}]") for k, v in value.items()}
    kind = value[TAG]
    try:
        return _DECODERS[kind](value, where)
    except KeyError as exc:
        if kind not in _DECODERS:
            raise _Malformed(where, f"unknown kind {kind!r}") from None
        raise _Malformed(where, f"{kind} lacks field {exc}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise _Malformed(where, f"{kind}: {exc}") from None


def _dec_items(value: dict, where: str) -> list:
    items = value["items"]
    if not isinstance(items, list):
        raise TypeError("items must be a list")
    return [_dec(v, f"{where}[{i}]") for i, v in enumerate(items)]


def _dec_pairs(value: dict, where: str) -> list[tuple[Any, Any]]:
    pairs = _dec_items(value, where)
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise TypeError("items must be [key, value] pairs")
    return [(k, v) for k, v in pairs]


def _dec_float(value: dict, where: str) -> float:
    text = value["value"]
    if text not in ("nan", "inf", "-inf"):
        raise ValueError(f"value must be 'nan', 'inf' or '-inf', got {text!r}")
    return float(text)


def _dec_dtype(value: dict, where: str) -> torch.dtype:
    dtype = getattr(torch, str(value["name"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{value['name']!r} is not a torch dtype")
    return dtype


def _dec_tensor(value: dict, where: str) -> torch.Tensor:
    dtype = _dec_dtype({"name": value["dtype"]}, where)
    shape = value["shape"]
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"shape must be a list of non-negative integers, got {shape!r}")
    raw = base64.b64decode(value["base64"], validate=True)
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != numel * itemsize:  # checked before any tensor is built from the declared shape
        raise ValueError(f"{len(raw)} data bytes for shape {shape} of {dtype} ({numel * itemsize} expected)")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(dtype).reshape(shape)
    if "device" in value:
        tensor = tensor.to(torch.device(value["device"]))
    if value.get("parameter") is True:
        return torch.nn.Parameter(tensor, requires_grad=value.get("requires_grad") is True)
    return tensor.requires_grad_(value.get("requires_grad") is True)


def _dec_numpy(value: dict, where: str) -> Any:
    import numpy as np

    dtype = np.dtype(str(value["dtype"]))
    if dtype.kind not in _NUMPY_KINDS or dtype.fields:
        raise ValueError(f"numpy dtype {value['dtype']!r} is not a plain numeric type")
    raw = base64.b64decode(value["base64"], validate=True)
    shape = value.get("shape", [])
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"shape must be a list of non-negative integers, got {shape!r}")
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{len(raw)} data bytes for shape {shape} of {dtype}")
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    return array if value[TAG] == "ndarray" else array[()]


def _dec_namespace(value: dict, where: str) -> argparse.Namespace:
    items = value["items"]
    if not isinstance(items, dict):
        raise TypeError("items must be an object")
    return argparse.Namespace(**{k: _dec(v, f"{where}.{k}") for k, v in items.items()})


_DECODERS = {
    "float": _dec_float,
    "complex": lambda v, w: complex(float.fromhex(v["real"]), float.fromhex(v["imag"])),
    "tuple": lambda v, w: tuple(_dec_items(v, w)),
    "set": lambda v, w: set(_dec_items(v, w)),
    "frozenset": lambda v, w: frozenset(_dec_items(v, w)),
    "dict": lambda v, w: dict(_dec_pairs(v, w)),
    "odict": lambda v, w: OrderedDict(_dec_pairs(v, w)),
    "bytes": lambda v, w: base64.b64decode(v["base64"], validate=True),
    "bytearray": lambda v, w: bytearray(base64.b64decode(v["base64"], validate=True)),
    "dtype": _dec_dtype,
    "device": lambda v, w: torch.device(str(v["name"])),
    "size": lambda v, w: torch.Size([int(s) for s in v["items"]]),
    "namespace": _dec_namespace,
    "tensor": _dec_tensor,
    "ndarray": _dec_numpy,
    "npscalar": _dec_numpy,
}
