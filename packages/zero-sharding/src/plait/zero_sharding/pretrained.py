"""Load pretrained safetensors weights into a model built under ``sharded_init``, one tensor at a time.

``from_pretrained`` in most libraries reads a whole shard (or the whole state dict) before it
copies anything into the model, so loading costs the model's size on top of the model. Here the
checkpoint is read tensor by tensor, straight from its file into a buffer of that tensor's size,
and each value goes where the parameter's constructed value lives: for a model built under
``sharded_init(placement=...)`` with offloaded parameters that is the placement's shard storage
(on disk), so the value is written there and its buffer freed before the next tensor is read.
Loading then costs the largest tensor, not the model (DeepSpeed's ``zero.Init`` plus
``from_pretrained`` does the same with its partitioned parameters).

The file format is safetensors': an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. A directory written by HF's
``save_pretrained`` holds either one ``model.safetensors`` or several shards and a
``model.safetensors.index.json`` mapping each tensor to its shard. The files are read with
``os.preadv`` (no memory map: mapped pages of a file count in the process's resident set until it
is unmapped) and their page cache is dropped after each tensor, so a cgroup's memory limit is not
filled with checkpoint pages either.

Every header is read and checked against the model before any value changes: a tensor the model
lacks, a parameter the checkpoint lacks or a shape that differs is refused naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import torch
from torch import nn

from plait.zero_sharding.construction import ConstructedParameter, _store_slice

# safetensors' dtype names (the format's specification).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor's bytes are.

    Attributes:
        name: the tensor's name in the checkpoint.
        file: the safetensors file holding it.
        dtype: its torch dtype.
        shape: its shape.
        offset: the byte offset of its data in ``file``.
        nbytes: the size of its data.
    """

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_safetensors` did.

    Attributes:
        loaded: the names of the model's parameters and buffers given checkpoint values.
        largest_tensor_bytes: the largest tensor read (what loading holds in memory at once).
        files: the safetensors files read.
    """

    loaded: tuple[str, ...]
    largest_tensor_bytes: int
    files: tuple[str, ...]


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint.

    Args:
        path: a ``.safetensors`` file, or a directory written by ``save_pretrained`` (one
            ``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

    Returns:
        The files, in the index's order.

    Raises:
        FileNotFoundError: ``path`` is neither, naming what was looked for.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"load_safetensors: no {SINGLE_NAME} or {INDEX_NAME} in {path!r}; give a directory "
                            "written by save_pretrained(safe_serialization=True) or a .safetensors file.")


def read_header(file: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, from its header alone (no data is read).

    Raises:
        ValueError: the header is damaged, names an unknown dtype, or a tensor's bytes lie outside
            the file or do not match its shape.
    """
    size = os.path.getsize(file)
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"load_safetensors: {file!r} is {size} bytes, too short for a safetensors header.")
        length = struct.unpack("<Q", head)[0]
        if length > size - 8:
            raise ValueError(f"load_safetensors: {file!r} declares a {length}-byte header in a {size}-byte file.")
        header = json.loads(handle.read(length))
    base, entries = 8 + length, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"load_safetensors: {file!r} tensor {name!r} has dtype {info['dtype']!r}, which plait "
                             f"does not read; supported: {sorted(_DTYPES)}.")
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected or base + end > size:
            raise ValueError(f"load_safetensors: {file!r} tensor {name!r} ({info['dtype']} {list(shape)}) has bytes "
                             f"{begin}-{end} of a {size - base}-byte data section; the file is damaged or truncated.")
        entries.append(TensorEntry(name, file, dtype, shape, base + begin, end - begin))
    return entries


def read_tensor(entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor from its file into ``out`` (or a new tensor), then drop its page cache.

    Args:
        entry: from :func:`read_header`.
        out: a contiguous CPU tensor of ``entry.nbytes`` bytes to read into (any dtype); its
            bytes are reinterpreted as ``entry.dtype``.

    Returns:
        The tensor, of ``entry.shape`` and ``entry.dtype``.

    Raises:
        ValueError: the file ended early.
    """
    if out is None:
        out = torch.empty(entry.shape, dtype=entry.dtype)
    raw = out.view(torch.uint8).reshape(-1) if out.numel() else out.view(torch.uint8)
    view = memoryview(raw.numpy()) if entry.nbytes else memoryview(b"")
    fd = os.open(entry.file, os.O_RDONLY)
    try:
        done = 0
        while done < entry.nbytes:
            got = os.preadv(fd, [view[done:]], entry.offset + done)
            if got == 0:
                raise ValueError(f"load_safetensors: {entry.file!r} ended {entry.nbytes - done} bytes short of tensor "
                                 f"{entry.name!r}; the file is truncated.")
            done += got
        # The checkpoint is read once: its pages would only crowd a memory cap (page cache is
        # charged to the reading cgroup).
        os.posix_fadvise(fd, entry.offset, entry.nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return out.view(entry.dtype).view(entry.shape)


def load_safetensors(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> LoadedWeights:
    """Give ``model`` the weights of a safetensors checkpoint, one tensor in memory at a time.

    Use it between ``sharded_init`` and ``zero_shard``::

        with sharded_init(placement=placement):
            model = LlamaForCausalLM(config)
        load_safetensors(model, "path/to/checkpoint")
        model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement)

    Parameters built under ``sharded_init`` keep only the new value's slice (on disk with an
    offloading placement); plain parameters and buffers are copied into. A checkpoint of another
    dtype is converted to each parameter's dtype. Tied parameters are loaded once, under any of
    their names.

    Args:
        model: built under ``sharded_init()`` (``init="construct"``, with or without a placement)
            or without plait.
        path: a ``.safetensors`` file or a ``save_pretrained`` directory.
        strict: refuse a checkpoint tensor the model lacks and a parameter the checkpoint lacks
            (``False``: skip the first, leave the second as constructed).

    Returns:
        A :class:`LoadedWeights`.

    Raises:
        ValueError: before any value changes, naming the tensor: a shape differs, a name is
            missing on either side (``strict``), a parameter is on the meta device
            (``sharded_init(init="meta")`` has no values to replace: build with the default
            ``init="construct"``), or a file is damaged.
        FileNotFoundError: no checkpoint at ``path``.
    """
    files = checkpoint_files(path)
    entries = [entry for file in files for entry in read_header(file)]
    targets = _targets(model)
    plan = _plan(entries, targets, strict)
    largest = 0
    with torch.no_grad():
        for entry, names in plan:
            _load_one(entry, targets[names[0]])
            largest = max(largest, entry.nbytes)
    loaded = tuple(name for _, names in plan for name in names)
    return LoadedWeights(loaded=loaded, largest_tensor_bytes=largest, files=tuple(files))


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name a checkpoint may use for a parameter or a persistent buffer (tied ones twice)."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(module_name)._non_persistent_buffers_set:
            targets[name] = buffer
    return targets


def _plan(entries: list[TensorEntry], targets: dict[str, torch.Tensor],
          strict: bool) -> list[tuple[TensorEntry, list[str]]]:
    """Match checkpoint tensors with the model's, checking everything before anything is read."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    plan, done, unexpected = [], set(), []
    for entry in entries:
        target = targets.get(entry.name)
        if target is None:
            unexpected.append(entry.name)
            continue
        if target.is_meta and not isinstance(target, ConstructedParameter):
            raise ValueError(f"load_safetensors: {entry.name!r} is on the meta device (sharded_init(init='meta') "
                             "keeps no values); build the model under sharded_init() with the default "
                             "init='construct', or with a placement, and load into it.")
        shape = tuple(target.shape)
        if shape != entry.shape:
            raise ValueError(f"load_safetensors: {entry.name!r} is {list(entry.shape)} in {entry.file!r} but "
                             f"{list(shape)} in the model; load a checkpoint of this model's configuration.")
        if id(target) in done:
            continue  # a tied parameter saved under two names: once is enough
        done.add(id(target))
        plan.append((entry, by_tensor[id(target)]))
    if strict and unexpected:
        raise ValueError(f"load_safetensors: the checkpoint has {len(unexpected)} tensors the model does not, e.g. "
                         f"{unexpected[:3]}; load the matching model class, or pass strict=False to skip them.")
    missing = [names[0] for key, names in by_tensor.items() if key not in done]
    if strict and missing:
        raise ValueError(f"load_safetensors: the model has {len(missing)} parameters or buffers the checkpoint does "
                         f"not, e.g. {missing[:3]}; load the matching checkpoint, or pass strict=False to keep their "
                         "constructed values.")
    return plan


def _load_one(entry: TensorEntry, target: torch.Tensor) -> None:
    """Read one tensor and hand it to its parameter (the storage, for a constructed one)."""
    if not isinstance(target, ConstructedParameter):
        target.copy_(read_tensor(entry))  # under no_grad: a leaf parameter may be written
        return
    buffer = None
    storage = target._plait_group.storage
    if entry.dtype == target._plait_dtype and hasattr(storage, "empty"):
        # Aligned memory: the storage writes it to disk with O_DIRECT and no bounce copy.
        buffer = storage.empty(math.prod(entry.shape), dtype=entry.dtype, device="cpu")
    value = read_tensor(entry, buffer)
    device = target._plait_slice.device if target._plait_slice is not None else target._plait_spilled[1]
    value = value.to(device=device, dtype=target._plait_dtype)
    # On one rank with a storage the value itself is written and dropped (no copy kept).
    _store_slice(target, value.reshape(-1))
