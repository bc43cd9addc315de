"""Hugging Face safetensors: export consolidated weights, and load weights piece by piece.

The safetensors format is small enough to speak directly (8-byte little-endian header length,
a JSON header of ``name -> {dtype, shape, data_offsets}``, then raw row-major bytes), so this
module needs no third-party package: export writes the files itself, and loading maps every
tensor to a checkpoint "piece" so :func:`plait.universal_ckpt.reader.read_region` reads only the
byte range each rank's piece needs. The real ``safetensors`` library and ``from_pretrained`` are
used only in the tests, to check the files.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.kernels.sharded_state import ShardSpec
from plait.universal_ckpt.adapters import ModuleAdapter, ShardedAdapter, adapt
from plait.universal_ckpt.errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError
from plait.universal_ckpt.exchange import Group
from plait.universal_ckpt.manifest import Layout, Manifest, Piece, TensorEntry, dtype_name
from plait.universal_ckpt.reader import read_full, read_manifest, read_region
from plait.universal_ckpt.storage import fsync_dir, tensor_bytes

INDEX_NAME = "model.safetensors.index.json"
# ZeRO producers (plait.zero_sharding, and DeepSpeed runs read by import_deepspeed) keep a model's
# parameters as "model.<name>" and its buffers as "buffer.<name>" next to their optimizer state and
# this loss-scaler entry; exports carry the model's own state_dict names instead.
ZERO_MARKER = "zero.loss_scaler"
TIED_ALIASES = "tied_aliases"  # a manifest's user_meta entry: {key: {alias: canonical}}, checkpoint naming
_ZERO_PREFIXES = {"parameter": "model.", "buffer": "buffer."}
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_FROM_CODE = {code: dtype for dtype, code in _CODES.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file (header padded to 8 bytes as the format asks) and fsync it."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        for tensor in tensors.values():
            file.write(tensor_bytes(tensor))
        file.flush()
        os.fsync(file.fileno())


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data begins."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > 100 << 20:
            raise CheckpointFormatError(f"{path} is not a safetensors file (header length {length}).")
        header = json.loads(file.read(length))
    return header, 8 + length


def export_hf(src: str | os.PathLike, dst: str | os.PathLike, *, key: str | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 2 << 30, config: Any = None,
              rename: Callable[[str], str] | None = None, verify: bool = True,
              progress: Callable[[int], None] | None = None) -> Path:
    """Write a checkpoint's consolidated weights as sharded safetensors plus their index.

    One tensor at a time is consolidated, and a shard at most is held in memory. Tied names the
    producer recorded (``user_meta["tied_aliases"]``, as the Lightning strategies write it) are
    written as copies, so the export has every key of the model's ``state_dict``.

    Args:
        src: a checkpoint directory or root.
        dst: the output directory (created); ``from_pretrained(dst)`` loads it when ``config``
            is given (or a ``config.json`` is already there).
        key: the state-dict key of the model (default: the only key holding parameters).
        dtype: cast floating tensors to this dtype (default: as saved).
        max_shard_bytes: size bound of each ``model-<i>-of-<n>.safetensors`` shard (5-digit numbers).
        config: an object with ``save_pretrained(dst)`` (an HF config) or a dict written as config.json.
        rename: maps checkpoint names to HF names (default: :func:`model_name`, the model's own
            ``state_dict`` names, which ``from_pretrained`` and ``load_state_dict`` expect).
        verify: check hashes while reading.
        progress: called with the bytes of each tensor written.

    Returns:
        ``dst``.

    Raises:
        CheckpointLayoutError: no parameters, several keys hold them and ``key`` is not given, or a
            weight-only quantized checkpoint (``export_quantized_hf`` writes those).
    """
    from plait.universal_ckpt.directory import resolve

    ckpt = resolve(src)
    manifest = read_manifest(ckpt)
    if "quantization" in manifest.user_meta:
        raise CheckpointLayoutError(
            f"{ckpt} holds weight-only quantized weights ({manifest.user_meta['quantization'].get('scheme')}); "
            "export_hf writes full-precision weights. Use plait.universal_ckpt.interop.hf_quantized."
            "export_quantized_hf (what `plait ckpt convert --to hf` calls for such a checkpoint).")
    keys = sorted({e.key for e in manifest.tensors.values() if e.kind == "parameter"})
    if key is None:
        if len(keys) != 1:
            raise CheckpointLayoutError(f"export_hf needs key=... : parameters live under {keys or 'no key'}.")
        key = keys[0]
    entries = [e for e in manifest.tensors.values() if e.key == key and e.kind in ("parameter", "buffer")]
    default_names = rename is None
    zero = f"{key}/{ZERO_MARKER}" in manifest.tensors
    kinds = {e.name: e.kind for e in entries}
    if rename is None:

        def rename(name: str) -> str:
            return model_name(name, kinds[name], zero=zero)

    def rename_alias(alias: str, canonical: str) -> str:
        # An alias is no entry of its own: the default naming takes its canonical entry's kind.
        return model_name(alias, kinds[canonical], zero=zero) if default_names else rename(alias)

    if not entries:
        raise CheckpointLayoutError(f"key {key!r} holds no parameters in {ckpt}; keys with parameters: {keys}.")
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    # Tied names (a head sharing the embedding's weight) recorded by the producer: each is written as
    # its own copy next to its first name, so the export has every key of the model's state_dict.
    names_of: dict[str, list[str]] = {}
    for alias, canonical in manifest.user_meta.get(TIED_ALIASES, {}).get(key, {}).items():
        names_of.setdefault(canonical, []).append(alias)
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in sorted(entries, key=lambda e: e.name):
        copies = 1 + len(names_of.get(entry.name, ()))
        nbytes = copies * math.prod(entry.global_shape) * (dtype or entry.torch_dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for entry in shard:
            tensor = read_full(ckpt, manifest, entry, verify=verify)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            for index_name, hf_name in enumerate([rename(entry.name)] +
                                                 [rename_alias(a, entry.name) for a in names_of.get(entry.name, ())]):
                tensors[hf_name] = tensor if index_name == 0 else tensor.clone()  # safetensors refuses shared storage
                weight_map[hf_name] = name
                total += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress(tensor.numel() * tensor.element_size())
        write_safetensors(out / name, tensors)
        del tensors
    index_body = {"metadata": {"total_size": total, "plait_step": manifest.step}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index_body, indent=2) + "\n")
    if config is not None:
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(out)
        else:
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    fsync_dir(out)
    return out


def model_name(name: str, kind: str, *, zero: bool) -> str:
    """The model's own ``state_dict`` name of a checkpoint tensor.

    Args:
        name: the tensor's name in the checkpoint (within its key).
        kind: its kind (``parameter``, ``buffer``, ...).
        zero: whether the key was written by a ZeRO producer (it holds ``zero.loss_scaler``), whose
            names carry ``model.`` (parameters) and ``buffer.`` (buffers) prefixes.

    Returns:
        ``name`` without the ZeRO producer's prefix; other producers' names unchanged.
    """
    prefix = _ZERO_PREFIXES.get(kind, "")
    return name[len(prefix):] if zero and prefix and name.startswith(prefix) else name


def hf_manifest(src: str | os.PathLike, *, key: str = "model") -> tuple[Path, Manifest]:
    """Describe a safetensors directory (or single file) as a manifest of unhashed pieces.

    Every tensor becomes one full piece pointing into its file, so the checkpoint reader can read
    any sub-range of it without loading the rest.

    Raises:
        CheckpointNotFoundError: no ``.safetensors`` file at ``src``.
    """
    path = Path(src)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"no .safetensors files at {path}.")
    base = files[0].parent
    tensors, sizes = {}, {}
    for file in files:
        header, start = read_header(file)
        sizes[file.name] = file.stat().st_size
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _FROM_CODE:
                raise CheckpointFormatError(f"{file.name}: tensor {name!r} has unsupported dtype {meta['dtype']}.")
            begin, end = meta["data_offsets"]
            shape = tuple(meta["shape"])
            piece = Piece(file=file.name, offset=start + begin, nbytes=end - begin, flat_range=(0, math.prod(shape)),
                          slices=None, hashes=())
            tensors[f"{key}/{name}"] = TensorEntry(key=key, name=name, kind="parameter", global_shape=shape,
                                                   dtype=dtype_name(_FROM_CODE[meta["dtype"]]), nbytes=end - begin,
                                                   pieces=(piece,))
    return base, Manifest(step=0, layout=Layout(), tensors=tensors, objects={}, files=sizes)


def load_hf_weights(target: Any, src: str | os.PathLike, *, rename: Callable[[str], str] | None = None,
                    strict: bool = True, group: Any | None = None) -> list[str]:
    """Fill a model's parameters from HF safetensors, each rank reading only its own pieces.

    Args:
        target: a ShardedStateful producer (its parameter/buffer pieces are filled, then
            ``load_sharded_state_dict`` is called) or a plain ``nn.Module`` (filled in place).
        src: a directory of ``*.safetensors`` (sharded or not) or one file.
        rename: maps the target's names to HF names (default: unchanged).
        strict: every parameter of the target must be found.
        group: process group (for the replica layout of plain modules).

    Returns:
        The target names filled.

    Raises:
        CheckpointLayoutError: missing tensors (strict) or shape mismatches.
    """
    base, manifest = hf_manifest(src)
    adapter = adapt({"model": target}, Group.of(group).ranks)[0]
    if not isinstance(adapter, ShardedAdapter | ModuleAdapter):
        raise CheckpointLayoutError(f"load_hf_weights needs a module or ShardedStateful, got {type(target).__name__}.")
    pieces = adapter.tensors_for_load({})
    filled, problems = [], []
    for piece in pieces.values():
        name = piece.spec.name  # several pieces of one tensor share it (piece_key)
        if piece.spec.kind not in ("parameter", "buffer"):
            continue
        entry = manifest.tensors.get(f"model/{rename(name) if rename else name}")
        if entry is None:
            if strict and piece.spec.kind == "parameter":
                problems.append(f"{name} not found")
            continue
        if entry.global_shape != piece.spec.global_shape:
            problems.append(f"{name}: file has {list(entry.global_shape)}, target {list(piece.spec.global_shape)}")
            continue
        filled.append((name, piece, entry))
    if problems:
        raise CheckpointLayoutError(f"cannot load {src} into the target: " + "; ".join(problems[:20]))
    with torch.no_grad():
        for _, piece, entry in filled:
            values = read_region(base, manifest, entry, ShardSpec(
                name=piece.spec.name, kind=piece.spec.kind, global_shape=piece.spec.global_shape,
                dtype=entry.torch_dtype, flat_range=piece.spec.flat_range, slices=piece.spec.slices), verify=False)
            piece.local.copy_(values.reshape(piece.local.shape).to(piece.spec.dtype))
    adapter.finish_load(pieces, None)
    return sorted({name for name, _, _ in filled})


def import_hf(src: str | os.PathLike, dst_root: str | os.PathLike, *, key: str = "model", step: int = 0,
              progress: Callable[[int], None] | None = None) -> Path:
    """Convert HF safetensors (sharded or not) into a universal checkpoint, one tensor in memory at a time.

    Args:
        src: directory of ``*.safetensors`` or one file.
        dst_root: the universal checkpoint root.
        key: the state-dict key the weights go under (``load({key: model}, ...)``).
        step: the step to record.
        progress: called with the bytes of each tensor written.

    Returns:
        The committed checkpoint directory.
    """
    from plait.universal_ckpt.offline import write_offline

    base, manifest = hf_manifest(src, key=key)

    def tensors():
        for entry in manifest.tensors.values():
            yield key, entry.name, "parameter", read_full(base, manifest, entry, verify=False)

    return write_offline(dst_root, step=step, tensors=tensors(), user_meta={"imported_from": "hf"}, progress=progress)
