"""``plait ckpt quantize``: a weight-only int8/int4 universal checkpoint from any universal checkpoint.

The formats are those of :mod:`plait.kernels.ops.quant_matmul` (int8: one fp32 scale per output
channel; int4: groups along in_features, symmetric or with uint8 zero points), so a quantized
checkpoint loads straight into a model quantized in memory by
``plait.inference_kernels.quantization.quantize``: a weight ``<m>.weight`` ``[N, K]`` is stored as

* ``<m>.weight_codes``: int8 ``[N, K]`` (int8) or uint8 ``[N, K / 2]`` (int4, two codes a byte);
* ``<m>.weight_scales``: float32 ``[N, 1]`` (int8) or ``[N, K / group_size]`` (int4);
* ``<m>.weight_zeros``: uint8 ``[N, K / group_size]``, asymmetric int4 only,

the names of ``QuantizedLinear``'s buffers. The manifest's ``user_meta["quantization"]`` records
the scheme (:data:`FORMAT`, version, bits, group size, symmetry), the key, every quantized weight
with its original shape and dtype, and the weights kept in full precision with the reason. The
new checkpoint has its own hashes and is committed atomically; the source is read with its hashes
checked and never modified.

Which weights are quantized: every 2-D floating ``*.weight`` parameter of the model key, except
the input embedding (names containing ``embed``, ``wte`` or ``wpe``; ``include_embedding=True``
quantizes those), the output head (``lm_head.weight``; ``include_head=True``), MoE routers
(``*.gate.weight``, ``*router*``) and the ``skip`` patterns. Fused 3-D expert tensors and 1-D
tensors are copied as they are. Only the model key is written: optimizer state, other keys and
the per-rank objects (RNG, scheduler) are training state a served model does not use; the report
lists what was left out.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from plait.kernels.ops.quant_matmul import SUPPORTED_DTYPES, QuantScheme, check_weight_shape, quantize_weight
from plait.universal_ckpt.errors import CheckpointExistsError, CheckpointLayoutError
from plait.universal_ckpt.interop.hf import TIED_ALIASES, ZERO_MARKER, model_name
from plait.universal_ckpt.manifest import Manifest, TensorEntry
from plait.universal_ckpt.reader import check_files, read_full, read_manifest

QUANTIZATION = "quantization"  # the manifest's user_meta entry of a quantized checkpoint
FORMAT = "plait-weight-only"
FORMAT_VERSION = 1
SUFFIXES = ("weight_codes", "weight_scales", "weight_zeros")
_EMBEDDING_MARKS = ("embed", "wte", "wpe")
_HEAD_NAMES = ("lm_head.weight",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointQuantizeConfig:
    """How :func:`quantize_checkpoint` quantizes a checkpoint.

    Attributes:
        bits: 8 (per output channel, symmetric) or 4 (group-wise).
        group_size: int4 group size along in_features: 32, 64 or 128 (default 64). None for int8.
        symmetric: int4 only: False stores a uint8 zero point per group.
        include_head: also quantize the output head (``lm_head.weight``).
        include_embedding: also quantize the input embedding.
        skip: fnmatch patterns of weight names (``"*.down_proj.weight"``) kept in full precision;
            each must match a weight that would otherwise be quantized.
        key: the state-dict key holding the model (default: the only key holding parameters).
    """

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    include_head: bool = False
    include_embedding: bool = False
    skip: tuple[str, ...] = ()
    key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (8, 4):
            raise ValueError(f"CheckpointQuantizeConfig.bits={self.bits!r} is not supported; use 8 or 4.")
        if self.bits == 8 and self.group_size is not None:
            raise ValueError(f"CheckpointQuantizeConfig.group_size={self.group_size!r} with bits=8: int8 uses one "
                             "scale per output channel; leave group_size unset (or use bits=4).")
        for name in ("symmetric", "include_head", "include_embedding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CheckpointQuantizeConfig.{name}={getattr(self, name)!r} must be True or False.")
        if not isinstance(self.skip, tuple) or not all(isinstance(p, str) and p for p in self.skip):
            raise ValueError(f"CheckpointQuantizeConfig.skip={self.skip!r} must be a tuple of weight-name patterns.")
        self.scheme  # noqa: B018 - validates group_size and symmetric, naming the field

    @property
    def scheme(self) -> QuantScheme:
        """The :class:`QuantScheme` of every quantized weight."""
        if self.bits == 8:
            if not self.symmetric:
                raise ValueError("CheckpointQuantizeConfig.symmetric=False with bits=8: only int4 has zero points.")
            return QuantScheme(kind="int8")
        return QuantScheme(kind="int4", group_size=64 if self.group_size is None else self.group_size,
                           symmetric=self.symmetric)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeCheckpointReport:
    """What :func:`quantize_checkpoint` wrote.

    Attributes:
        path: the committed quantized checkpoint directory.
        quantized: names of the quantized weights (``<m>.weight``).
        kept: ``(name, reason)`` of 2-D weights kept in full precision.
        dropped: full names (``key/name``) of source tensors not written (optimizer state, other
            keys), plus ``"objects"`` when the source had per-rank objects.
        bytes_before: bytes of the quantized weights in the source.
        bytes_after: bytes of their codes, scales and zero points.
    """

    path: Path
    quantized: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]
    dropped: tuple[str, ...]
    bytes_before: int
    bytes_after: int


def scheme_of(manifest: Manifest) -> dict | None:
    """The ``user_meta["quantization"]`` record of a quantized checkpoint, or None."""
    record = manifest.user_meta.get(QUANTIZATION)
    return record if isinstance(record, dict) else None


def describe(record: dict) -> str:
    """``"int4 group 64 symmetric (plait-weight-only v1)"``: a record's scheme in words."""
    scheme = record.get("scheme", {})
    group = f" group {scheme.get('group_size')}" if scheme.get("kind") == "int4" else " per channel"
    sym = "symmetric" if scheme.get("symmetric", True) else "asymmetric"
    return f"{scheme.get('kind')}{group} {sym} ({record.get('format')} v{record.get('version')})"


def refuse_unquantized(manifest: Manifest, key: str, wanted: set[str], where: str) -> None:
    """Refuse reading a quantized checkpoint's weights as full-precision tensors.

    Args:
        manifest: the checkpoint's manifest.
        key: the state-dict key being read.
        wanted: names the reader wants under ``key``.
        where: what is reading (for the message), e.g. ``"uc.load"``.

    Raises:
        CheckpointLayoutError: some wanted name is a weight the checkpoint holds quantized.
    """
    record = scheme_of(manifest)
    if record is None or record.get("key") != key:
        return
    hit = sorted(wanted & set(record.get("tensors", {})))
    if hit:
        raise CheckpointLayoutError(
            f"{where}: the checkpoint holds {len(record['tensors'])} weights quantized {describe(record)}, "
            f"e.g. {hit[0]} as {hit[0]}_codes/_scales; it cannot load as full-precision weights. Quantize the model "
            "the same way first (plait.inference_kernels.quantization.quantize with the matching QuantizeConfig), "
            "then load into it; or export it with `plait ckpt convert CKPT DST --to hf` (the compressed-tensors "
            "layout) and load that with plait.inference_kernels.quantization.load_quantized_pretrained or vLLM.")


def _role(name: str, config: CheckpointQuantizeConfig) -> str | None:
    """None to quantize ``name``, else why it is kept (for 2-D floating weights; other tensors are copied)."""
    base = name.rsplit(".", 1)[0]
    if any(mark in base.rsplit(".", 1)[-1] for mark in _EMBEDDING_MARKS) and not config.include_embedding:
        return "input embedding (--include-embedding quantizes it)"
    if name in _HEAD_NAMES or name.endswith("." + _HEAD_NAMES[0]):
        return None if config.include_head else "output head (--include-head quantizes it)"
    if name.endswith(".gate.weight") or "router" in name:
        return "MoE router (kept in full precision)"
    hit = [p for p in config.skip if fnmatch.fnmatchcase(name, p)]
    if hit:
        return f"skipped by pattern {hit[0]!r}"
    return None


def plan(manifest: Manifest, config: CheckpointQuantizeConfig) -> tuple[str, dict[str, TensorEntry], dict, list]:
    """Decide and check everything before any byte is written.

    Returns:
        ``(key, entries by model name, {name: reason} kept, names to quantize)``.

    Raises:
        CheckpointLayoutError: the checkpoint is already quantized, holds no parameters, the key
            is ambiguous, a skip pattern matches nothing, or nothing would be quantized.
        ValueError: a weight the scheme cannot hold (dtype, or in_features not divisible by the
            group size), naming it and the fix.
    """
    if scheme_of(manifest) is not None:
        raise CheckpointLayoutError(f"the checkpoint is already quantized {describe(scheme_of(manifest))}; "
                                    "quantize its full-precision source instead.")
    keys = sorted({e.key for e in manifest.tensors.values() if e.kind == "parameter"})
    key = config.key
    if key is None:
        if len(keys) != 1:
            raise CheckpointLayoutError(f"parameters live under keys {keys or 'none'}; pass --key (key=...) naming "
                                        "the model's.")
        key = keys[0]
    elif key not in keys:
        raise CheckpointLayoutError(f"key {key!r} holds no parameters; keys with parameters: {keys}.")
    zero = f"{key}/{ZERO_MARKER}" in manifest.tensors
    entries = {model_name(e.name, e.kind, zero=zero): e for e in manifest.tensors.values()
               if e.key == key and e.kind in ("parameter", "buffer")}
    kept, targets, used = {}, [], set()
    for name, entry in sorted(entries.items()):
        if entry.kind != "parameter" or len(entry.global_shape) != 2 or not name.endswith(".weight") \
                or not entry.torch_dtype.is_floating_point:
            continue
        used.update(p for p in config.skip if fnmatch.fnmatchcase(name, p))
        reason = _role(name, config)
        if reason is not None:
            kept[name] = reason
            continue
        if entry.torch_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype {entry.dtype} is not supported; convert the checkpoint to fp32, bf16 "
                             f"or fp16 first, or keep it with --skip '{name}'.")
        try:
            check_weight_shape(entry.global_shape, config.scheme, name=name)
        except ValueError as exc:
            raise ValueError(f"{exc} (--skip '{name}' keeps it)") from None
        targets.append(name)
    unused = [p for p in config.skip if p not in used]
    if unused:
        raise CheckpointLayoutError(f"skip pattern(s) {unused} match no 2-D weight of key {key!r}; fix or drop them.")
    if not targets:
        raise CheckpointLayoutError(f"key {key!r} has no weight to quantize (kept: {sorted(kept) or 'none'}).")
    return key, entries, kept, targets


def _stream(ckpt: Path, manifest: Manifest, key: str, entries: dict[str, TensorEntry], targets: list[str],
            scheme: QuantScheme, aliases: dict[str, str]) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """The new checkpoint's tensors, one source tensor in memory at a time (hashes checked)."""
    quantize_names = set(targets)
    for name, entry in sorted(entries.items()):
        tensor = read_full(ckpt, manifest, entry, verify=True)
        for out in [name] + [a for a, c in aliases.items() if c == name]:
            if out not in quantize_names:
                yield key, out, entry.kind, tensor
                continue
            try:
                codes, scales, zeros = quantize_weight(tensor, scheme)
            except ValueError as exc:  # inf/NaN: found only once the bytes are read; nothing is committed
                raise ValueError(f"{out}: {exc}") from None
            stem = out[: -len("weight")]
            yield key, stem + "weight_codes", "buffer", codes
            yield key, stem + "weight_scales", "buffer", scales
            if zeros is not None:
                yield key, stem + "weight_zeros", "buffer", zeros


def quantize_checkpoint(src: str | os.PathLike, dst_root: str | os.PathLike, config: CheckpointQuantizeConfig,
                        *, hf_config: Any = None,
                        progress: Callable[[int], None] | None = None) -> QuantizeCheckpointReport:
    """Write a weight-only quantized universal checkpoint from a universal checkpoint.

    Args:
        src: a checkpoint directory or root (its latest); read with hashes checked, never modified.
        dst_root: the new checkpoint root; must not exist.
        config: the scheme and which weights.
        hf_config: the model's HF config (an object with ``save_pretrained`` or a dict). When
            given, ``dst_root/config.json`` is written with the compressed-tensors
            ``quantization_config`` (:func:`plait.universal_ckpt.interop.hf_quantized.write_config`),
            so vLLM serves the root with ``load_format="plait_universal"``.
        progress: called with the bytes of each tensor written.

    Returns:
        The :class:`QuantizeCheckpointReport`.

    Raises:
        CheckpointExistsError: ``dst_root`` exists (nothing is overwritten).
        CheckpointLayoutError, ValueError: see :func:`plan` (raised before anything is written); a
            weight holding inf/NaN (found while reading: nothing is committed).
        CheckpointIntegrityError: a source chunk fails its hash.
    """
    from plait.kernels.ops.quant_matmul import weight_nbytes
    from plait.universal_ckpt.directory import resolve
    from plait.universal_ckpt.offline import write_offline

    ckpt = resolve(src)
    manifest = read_manifest(ckpt)
    check_files(ckpt, manifest)
    dst = Path(dst_root)
    if dst.exists():
        raise CheckpointExistsError(f"{dst} exists; quantize into a new directory (nothing was written).")
    key, entries, kept, targets = plan(manifest, config)
    zero = f"{key}/{ZERO_MARKER}" in manifest.tensors
    by_stored = {e.name: (n, e.kind) for n, e in entries.items()}
    tied = {model_name(a, by_stored[c][1], zero=zero): by_stored[c][0]  # checkpoint names -> the model's
            for a, c in manifest.user_meta.get(TIED_ALIASES, {}).get(key, {}).items()
            if c in by_stored and a not in by_stored}  # an alias also stored by name is an ordinary tensor
    scheme = config.scheme
    quantized = set(targets)
    # A tied alias (a head sharing the embedding's weight) stays an alias only when neither name is
    # quantized; otherwise it is written as its own tensor, quantized when its own role says so.
    written_aliases, keep_aliases = {}, {}
    for alias, canonical in tied.items():
        reason = _role(alias, config)
        if reason is None:
            check_weight_shape(entries[canonical].global_shape, scheme, name=alias)
            quantized.add(alias)
        else:
            kept[alias] = reason
        if alias in quantized or canonical in quantized:
            written_aliases[alias] = canonical
        else:
            keep_aliases[alias] = canonical
    shapes = {n: entries[written_aliases.get(n, n)] for n in quantized}
    record = {"format": FORMAT, "version": FORMAT_VERSION, "key": key, "bits": config.bits,
              "scheme": scheme.to_json(),
              "tensors": {n: {"shape": list(e.global_shape), "dtype": e.dtype} for n, e in sorted(shapes.items())},
              "kept": dict(sorted(kept.items())), "source_step": manifest.step}
    meta = {QUANTIZATION: record, **({TIED_ALIASES: {key: keep_aliases}} if keep_aliases else {})}
    dropped = sorted(full for full, e in manifest.tensors.items()
                     if not (e.key == key and e.kind in ("parameter", "buffer")))
    path = write_offline(dst, step=manifest.step, user_meta=meta, progress=progress,
                         tensors=_stream(ckpt, manifest, key, entries, sorted(quantized), scheme, written_aliases))
    before = sum(e.nbytes for e in shapes.values())
    after = sum(weight_nbytes(tuple(e.global_shape), scheme) for e in shapes.values())
    if hf_config is not None:
        from plait.universal_ckpt.interop.hf_quantized import write_config

        write_config(record, dst, hf_config)
    return QuantizeCheckpointReport(path=path, quantized=tuple(sorted(quantized)), kept=tuple(sorted(kept.items())),
                                    dropped=tuple(dropped) + (("objects",) if manifest.objects else ()),
                                    bytes_before=before, bytes_after=after)
