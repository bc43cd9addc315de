"""HF export of a weight-only quantized checkpoint in compressed-tensors' ``pack-quantized`` layout.

``pack-quantized`` is the layout that vLLM (``CompressedTensorsWNA16``; on CPU its
``CPUWNA16LinearKernel`` serves 4-bit weights) and transformers' compressed-tensors quantizer
read. A plait weight ``<m>.weight`` ``[N, K]`` (see :mod:`plait.universal_ckpt.quantize`) is
written as:

* ``<m>.weight_packed``: int32 ``[N, K * bits / 32]``. compressed-tensors stores the signed code
  ``q_s`` as ``q_s + 2^(bits-1)`` and packs ``32 / bits`` of them into an int32, element ``j`` at
  bits ``bits * j``. For int4 that stored value is plait's nibble ``q`` (``q_s = q - 8``), in
  plait's order, so the int32 words are plait's bytes read little-endian; for int8 it is the
  int8 code plus 128.
* ``<m>.weight_scale``: float32 ``[N, groups]`` (``[N, 1]`` for int8: strategy ``channel``).
* ``<m>.weight_zero_point`` (asymmetric int4): plait's uint8 zero points ``z`` (stored value of
  ``z_s = z - 8``) packed eight to an int32 along dim 0: ``[ceil(N / 8), groups]``.
* ``<m>.weight_shape``: int64 ``[2]``.

Dequantization is ``(q_s - z_s) * scale = (q - z) * scale`` in both, so the export is exact. The
``quantization_config`` in config.json names the scheme and lists the Linears kept in full
precision under ``ignore``. No compressed-tensors package is needed to write it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.universal_ckpt.directory import resolve
from plait.universal_ckpt.errors import CheckpointLayoutError
from plait.universal_ckpt.interop.hf import INDEX_NAME, TIED_ALIASES, write_safetensors
from plait.universal_ckpt.quantize import describe, scheme_of
from plait.universal_ckpt.reader import read_full, read_manifest
from plait.universal_ckpt.storage import fsync_dir

LAYOUT = "compressed-tensors pack-quantized"


def quantization_config(record: dict) -> dict:
    """The config.json ``quantization_config`` (compressed-tensors, pack-quantized) of a quantized checkpoint.

    Args:
        record: the checkpoint's ``user_meta["quantization"]``.

    Returns:
        A JSON-able dict; ``plait`` carries plait's own record.
    """
    scheme = record["scheme"]
    int4 = scheme["kind"] == "int4"
    weights = {"num_bits": 4 if int4 else 8, "type": "int", "symmetric": scheme["symmetric"],
               "strategy": "group" if int4 else "channel", "group_size": scheme["group_size"] if int4 else None,
               "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
               "block_structure": None}
    ignore = sorted(name.removesuffix(".weight") for name in record.get("kept", {}))
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ignore, "kv_cache_scheme": None, "plait": record}


def pack_zero_points(zeros: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, G]`` zero points -> int32 ``[ceil(N / 8), G]``, eight 4-bit values along dim 0."""
    n, groups = zeros.shape
    z = torch.zeros(groups, -(-n // 8) * 8, dtype=torch.int32)
    z[:, :n] = zeros.T.to(torch.int32)
    words = sum(z[:, j::8] << (4 * j) for j in range(8))
    return words.T.contiguous().to(torch.int32)


def _weight_packed(codes: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "int8":
        codes = (codes.to(torch.int16) + 128).to(torch.uint8)
    return codes.contiguous().view(torch.int32)


def hf_tensors(record: dict, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One tensor of a quantized checkpoint in the pack-quantized layout (names and dtypes).

    Args:
        record: the checkpoint's ``user_meta["quantization"]``.
        name: the tensor's model name (``<m>.weight_codes``, ``<m>.weight_scales``, ... or any other).
        tensor: its value.

    Returns:
        ``[(hf_name, tensor), ...]``: codes give ``weight_packed`` and ``weight_shape``; scales
        ``weight_scale``; zero points ``weight_zero_point``; other tensors pass unchanged.
    """
    stem, _, suffix = name.rpartition(".")
    if f"{stem}.weight" not in record["tensors"] or suffix not in ("weight_codes", "weight_scales", "weight_zeros"):
        return [(name, tensor)]
    if suffix == "weight_codes":
        shape = torch.tensor(record["tensors"][f"{stem}.weight"]["shape"])
        return [(f"{stem}.weight_packed", _weight_packed(tensor.clone(), record["scheme"]["kind"])),
                (f"{stem}.weight_shape", shape)]
    if suffix == "weight_scales":
        return [(f"{stem}.weight_scale", tensor)]
    return [(f"{stem}.weight_zero_point", pack_zero_points(tensor))]


def write_config(record: dict, dst: Path, config: Any = None) -> Path:
    """Write ``dst/config.json``: ``config`` (or the one already there) plus the ``quantization_config``.

    Raises:
        CheckpointLayoutError: no config given and none in ``dst``.
    """
    if config is None and not (dst / "config.json").is_file():
        raise CheckpointLayoutError(f"the export ({describe(record)}) needs the model's HF config: pass "
                                    "config=... (or --config), or put config.json in the destination first.")
    if config is not None:
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(dst)
        else:
            (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    body = json.loads((dst / "config.json").read_text())
    body["quantization_config"] = quantization_config(record)
    (dst / "config.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return dst / "config.json"


def _check(record: dict, ckpt: Path) -> None:
    """Refuse what the layout cannot hold, before anything is written."""
    quantized = record["tensors"]
    embedded = [n for n in quantized if any(m in n.rsplit(".", 2)[-2] for m in ("embed", "wte", "wpe"))]
    if embedded:
        raise CheckpointLayoutError(
            f"{ckpt}: {embedded[0]} is quantized, but compressed-tensors' pack-quantized layout quantizes Linear "
            "layers only; quantize the checkpoint again without --include-embedding.")
    per_word = 4 if record["scheme"]["kind"] == "int8" else 8
    for name, info in quantized.items():
        if info["shape"][1] % per_word:
            raise CheckpointLayoutError(f"{name}: in_features={info['shape'][1]} is not a multiple of {per_word}, "
                                        "which the int32 packing needs; keep it with --skip when quantizing.")


def export_quantized_hf(src: str | os.PathLike, dst: str | os.PathLike, *, config: Any = None,
                        max_shard_bytes: int = 2 << 30, verify: bool = True,
                        progress: Callable[[int], None] | None = None) -> Path:
    """Write a quantized checkpoint as HF safetensors in compressed-tensors' pack-quantized layout.

    Args:
        src: a quantized checkpoint directory or root (``plait ckpt quantize``'s output).
        dst: the output directory (created). Its config.json gets the ``quantization_config``.
        config: the HF config (``save_pretrained``) or a dict for config.json; without it an
            existing ``dst/config.json`` is used.
        max_shard_bytes: size bound of each ``model-<i>-of-<n>.safetensors`` shard.
        verify: check hashes while reading.
        progress: called with the bytes of each tensor written.

    Returns:
        ``dst``.

    Raises:
        CheckpointLayoutError: not a quantized checkpoint (use ``export_hf``), a quantized
            embedding, in_features the int32 packing cannot hold, or no config to put the
            ``quantization_config`` in (all before anything is written).
    """
    ckpt = resolve(src)
    manifest = read_manifest(ckpt)
    record = scheme_of(manifest)
    if record is None:
        raise CheckpointLayoutError(f"{ckpt} is not weight-only quantized; export it with export_hf.")
    _check(record, ckpt)
    out = Path(dst)
    if config is None and not (out / "config.json").is_file():
        raise CheckpointLayoutError(f"export of {ckpt} ({describe(record)}) needs the model's HF config: pass "
                                    "config=... (or --config), or put config.json in the destination first.")
    key = record["key"]
    entries = sorted((e for e in manifest.tensors.values() if e.key == key), key=lambda e: e.name)
    aliases: dict[str, list[str]] = {}
    for alias, canonical in manifest.user_meta.get(TIED_ALIASES, {}).get(key, {}).items():
        aliases.setdefault(canonical, []).append(alias)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for entry in entries:
        tensor = read_full(ckpt, manifest, entry, verify=verify)
        named = dict(hf_tensors(record, entry.name, tensor))
        for alias in aliases.get(entry.name, ()):  # safetensors refuses shared storage: a copy each
            named[alias] = tensor.clone()
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(named)
        size += nbytes
        if progress is not None:
            progress(nbytes)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, shard)
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total, "plait_step": manifest.step},
                                              "weight_map": weight_map}, indent=2) + "\n")
    write_config(record, out, config)
    fsync_dir(out)
    return out
