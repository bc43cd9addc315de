"""The manifest: one JSON file that says everything a reader needs about a checkpoint.

The manifest is the only place where names, shapes, dtypes, file locations and hashes live, so a
program in any language can read a checkpoint from it (README "On-disk format" spells out every
field). It carries its own hash over its canonical JSON, so a damaged manifest is refused
instead of silently steering a load to the wrong bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import torch

from plait.universal_ckpt.errors import CheckpointFormatError

MAGIC = "plait-universal-ckpt"
FORMAT_VERSION = 1
HASH_ALGORITHM = "sha256"
DEFAULT_CHUNK_BYTES = 4 << 20
MANIFEST_NAME = "manifest.json"

# Names follow torch's dtype attribute names, so ``getattr(torch, name)`` is the decoder.
_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool, "complex64": torch.complex64, "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for ``dtype`` (torch's attribute name, e.g. ``"bfloat16"``)."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be checkpointed; supported: {sorted(_DTYPES)}.")
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises CheckpointFormatError for an unknown name."""
    if name not in _DTYPES:
        raise CheckpointFormatError(f"manifest names dtype {name!r}, which this version does not know.")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """The producer's parallel layout, recorded for people and tools (loading never needs it).

    Attributes:
        world_size: ranks that saved.
        mesh: named mesh dimensions and sizes, e.g. ``{"dp": 2, "sp": 2}``.
        zero_stage: ZeRO stage of the producer (0 for plain/DDP state).
        expert_parallel_size: size of the expert-parallel dimension (1 without MoE).
        sequence_parallel_size: size of the sequence-parallel dimension (1 without it).
        offload: whether optimizer state (or parameters) lived on CPU/NVMe when saved.
    """

    world_size: int = 1
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    zero_stage: int = 0
    expert_parallel_size: int = 1
    sequence_parallel_size: int = 1
    offload: bool = False

    def __post_init__(self) -> None:
        for field in ("world_size", "expert_parallel_size", "sequence_parallel_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{field}={value!r} must be a positive int.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3.")
        if self.mesh and math.prod(self.mesh.values()) != self.world_size:
            raise ValueError(f"Layout.mesh={self.mesh} does not multiply to world_size={self.world_size}; "
                             "give sizes whose product is the world size.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Piece:
    """One stored piece of a tensor.

    Attributes:
        file: data file relative to the checkpoint directory.
        offset: byte offset of the piece in ``file``.
        nbytes: byte size of the piece (``numel * itemsize``), stored row-major, no padding.
        flat_range: ``[start, stop)`` into the row-major flattening of the global tensor, or None.
        slices: per-dimension ``[start, stop)`` boxes, or None (exactly one of the two is set).
        hashes: hex digests of consecutive ``chunk_bytes`` chunks of the piece (at least one).
        checksums: optional fast checksums (the manifest's ``checksum_algorithm``) of the same
            chunks, which loads check instead of ``hashes``; None in checkpoints written without
            them (loads then check ``hashes``).
    """

    file: str
    offset: int
    nbytes: int
    flat_range: tuple[int, int] | None
    slices: tuple[tuple[int, int], ...] | None
    hashes: tuple[str, ...]
    checksums: tuple[str, ...] | None = None

    @property
    def numel_local(self) -> int:
        """Elements in the piece."""
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(stop - start for start, stop in self.slices)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """Everything about one global tensor.

    Attributes:
        key: the top-level key of the saved state dict it came from (``"model"``, ``"optim"``).
        name: the tensor's name within that key (the producer's ShardSpec name).
        kind: ``parameter``, ``optimizer_state``, ``buffer``, ``gradient`` or ``other``.
        global_shape: shape of the whole tensor.
        dtype: manifest dtype name.
        nbytes: bytes of the whole tensor.
        pieces: where its pieces are stored; together they cover it exactly once.
        pattern: how the consolidated tensor maps to model-parallel pieces (the producer's
            :class:`~plait.universal_ckpt.layouts.TensorLayout` as JSON), or None; informational.
    """

    key: str
    name: str
    kind: str
    global_shape: tuple[int, ...]
    dtype: str
    nbytes: int
    pieces: tuple[Piece, ...]
    pattern: dict | None = None

    @property
    def full_name(self) -> str:
        """``key/name``: the tensor's name in the manifest."""
        return f"{self.key}/{self.name}"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The entry's dtype as a torch dtype."""
        return dtype_from_name(self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectFile:
    """One rank's non-tensor state (RNG, scheduler, scaler, data position, extra).

    Attributes:
        rank: the rank that wrote it.
        file: path relative to the checkpoint directory.
        nbytes: file size.
        hash: hex digest of the whole file.
        keys: the state-dict keys stored in it.
        encoding: ``"json"`` (read without any unpickler) or ``"pickle"`` (read with the
            restricted unpickler); manifests without the field are ``"pickle"``.
    """

    rank: int
    file: str
    nbytes: int
    hash: str
    keys: tuple[str, ...]
    encoding: str = "pickle"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """A checkpoint's manifest.

    Attributes:
        step: the training step the checkpoint belongs to.
        layout: the producer's layout.
        tensors: full name (``key/name``) -> entry.
        objects: rank -> that rank's object file.
        files: data file -> byte size, so truncation is caught before any read.
        chunk_bytes: hash chunk size of pieces.
        hash_algorithm: hashlib name of the digests.
        checksum_algorithm: name of the pieces' fast ``checksums`` (``"xxh3_64"``), or None when
            no piece has them.
        format_version: on-disk format version.
        created_unix: seconds since the epoch when rank 0 committed.
        user_meta: free-form JSON from the caller.
        pickled_objects: the object files may hold values outside the safe-type allowlist (saved
            with ``allow_pickle=True``); a load then needs ``trust_pickled_objects=True``.
    """

    step: int
    layout: Layout
    tensors: dict[str, TensorEntry]
    objects: dict[int, ObjectFile]
    files: dict[str, int]
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    hash_algorithm: str = HASH_ALGORITHM
    checksum_algorithm: str | None = None
    format_version: int = FORMAT_VERSION
    created_unix: float = 0.0
    user_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    pickled_objects: bool = False

    def entries_for(self, key: str) -> dict[str, TensorEntry]:
        """Entries of one top-level key, by name within the key."""
        return {entry.name: entry for entry in self.tensors.values() if entry.key == key}

    @property
    def keys(self) -> list[str]:
        """Top-level keys that have tensors or objects, sorted."""
        names = {entry.key for entry in self.tensors.values()}
        for obj in self.objects.values():
            names.update(obj.keys)
        return sorted(names)

    def to_json(self) -> str:
        """Serialise with the manifest hash as the last field."""
        body = _to_plain(self)
        body = {"magic": MAGIC, **body}
        body["manifest_hash"] = _body_hash(body)
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest.json") -> Manifest:
        """Parse and check a manifest.

        Raises:
            CheckpointFormatError: not JSON, not a plait manifest, a newer format version, or a
                manifest hash that does not match its contents (damage).
        """
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointFormatError(f"{source} is not valid JSON ({exc}); the manifest is damaged.") from exc
        if not isinstance(body, dict) or body.get("magic") != MAGIC:
            raise CheckpointFormatError(f"{source} is not a plait universal checkpoint manifest (no magic {MAGIC!r}).")
        version = body.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{source} has format_version={version!r}, newer than this plait-universal-ckpt reads "
                f"({FORMAT_VERSION}); upgrade with `pip install -U plait-universal-ckpt`."
            )
        stored = body.pop("manifest_hash", None)
        actual = _body_hash(body)
        if stored != actual:
            raise CheckpointFormatError(
                f"{source} is damaged: manifest_hash expected {stored}, actual {actual}.")
        from plait.universal_ckpt.manifest_checks import check_manifest

        try:
            manifest = _from_plain(body)
            check_manifest(manifest)  # the hash catches damage, not an edited and re-signed manifest
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise CheckpointFormatError(f"{source} is missing or has malformed fields: {exc!r}.") from exc
        return manifest


def _body_hash(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.new(HASH_ALGORITHM, canonical.encode()).hexdigest()


def _to_plain(manifest: Manifest) -> dict:
    def piece(p: Piece) -> dict:
        return {"file": p.file, "offset": p.offset, "nbytes": p.nbytes,
                "flat_range": list(p.flat_range) if p.flat_range is not None else None,
                "slices": [list(s) for s in p.slices] if p.slices is not None else None,
                "hashes": list(p.hashes),
                # written only when present: manifests without checksums hash as before
                **({"checksums": list(p.checksums)} if p.checksums is not None else {})}

    def entry(e: TensorEntry) -> dict:
        body = {"key": e.key, "name": e.name, "kind": e.kind, "global_shape": list(e.global_shape),
                "dtype": e.dtype, "nbytes": e.nbytes, "pieces": [piece(p) for p in e.pieces]}
        if e.pattern is not None:  # written only when present: older manifests hash as before
            body["pattern"] = e.pattern
        return body

    return {
        "format_version": manifest.format_version,
        "step": manifest.step,
        "created_unix": manifest.created_unix,
        "hash_algorithm": manifest.hash_algorithm,
        "chunk_bytes": manifest.chunk_bytes,
        **({"checksum_algorithm": manifest.checksum_algorithm} if manifest.checksum_algorithm is not None else {}),
        "layout": dataclasses.asdict(manifest.layout),
        "files": dict(sorted(manifest.files.items())),
        "objects": {str(rank): {"file": o.file, "nbytes": o.nbytes, "hash": o.hash, "keys": list(o.keys),
                                "encoding": o.encoding}
                    for rank, o in sorted(manifest.objects.items())},
        "tensors": {full: entry(e) for full, e in sorted(manifest.tensors.items())},
        "user_meta": manifest.user_meta,
        # written only when set: manifests of safe checkpoints hash as before
        **({"pickled_objects": True} if manifest.pickled_objects else {}),
    }


def _int(value: Any) -> int:
    """A JSON integer as is: a string or a float is refused, never coerced (``int(1.5)`` would be 1)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _from_plain(body: dict) -> Manifest:
    def piece(p: dict) -> Piece:
        return Piece(file=p["file"], offset=_int(p["offset"]), nbytes=_int(p["nbytes"]),
                     flat_range=tuple(p["flat_range"]) if p["flat_range"] is not None else None,
                     slices=tuple(tuple(s) for s in p["slices"]) if p["slices"] is not None else None,
                     hashes=tuple(p["hashes"]),
                     checksums=tuple(p["checksums"]) if p.get("checksums") is not None else None)

    tensors = {
        full: TensorEntry(key=e["key"], name=e["name"], kind=e["kind"], global_shape=tuple(e["global_shape"]),
                          dtype=e["dtype"], nbytes=_int(e["nbytes"]), pieces=tuple(piece(p) for p in e["pieces"]),
                          pattern=e.get("pattern"))
        for full, e in body["tensors"].items()
    }
    objects = {int(rank): ObjectFile(rank=int(rank), file=o["file"], nbytes=_int(o["nbytes"]), hash=o["hash"],
                                     keys=tuple(o["keys"]), encoding=o.get("encoding", "pickle"))
               for rank, o in body["objects"].items()}
    return Manifest(step=int(body["step"]), layout=Layout(**body["layout"]), tensors=tensors, objects=objects,
                    files={k: _int(v) for k, v in body["files"].items()}, chunk_bytes=int(body["chunk_bytes"]),
                    hash_algorithm=body["hash_algorithm"], checksum_algorithm=body.get("checksum_algorithm"),
                    format_version=int(body["format_version"]),
                    created_unix=float(body["created_unix"]), user_meta=body.get("user_meta", {}),
                    pickled_objects=body.get("pickled_objects", False) is True)
