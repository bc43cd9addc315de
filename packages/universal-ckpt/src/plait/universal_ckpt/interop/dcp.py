"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``): export and import.

Export writes consolidated tensors under their manifest names (``key/name``) plus one bytes
entry, ``__plait_universal_ckpt__``, carrying what DCP has no place for (kinds, step, layout,
every rank's non-tensor state), so ours -> DCP -> ours is lossless. Import accepts any DCP
checkpoint: tensors named ``key/name`` keep their key, others go under ``dcp``. Both run in one
process and hold the consolidated tensors in memory (DCP's own planner needs the whole state
dict up front).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.universal_ckpt.directory import resolve
from plait.universal_ckpt.errors import CheckpointFormatError
from plait.universal_ckpt.interop import restricted
from plait.universal_ckpt.offline import write_offline
from plait.universal_ckpt.reader import read_full, read_manifest, read_objects
from plait.universal_ckpt.safe_objects import load_objects

META_KEY = "__plait_universal_ckpt__"


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def _metadata_classes() -> tuple[type, ...]:
    """The plain data classes a DCP ``.metadata`` pickle names (constructing them runs no code of the file's)."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
             "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    return (*(getattr(metadata, n) for n in names if hasattr(metadata, n)), filesystem._StorageInfo,
            type(Path()))


def _safe_reader(src: str | os.PathLike) -> Any:
    """A DCP ``FileSystemReader`` whose metadata is read through plait's restricted unpickler.

    DCP itself reads ``.metadata`` with ``pickle.load``, which runs whatever a crafted file names.
    """
    dcp = _dcp()

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            module = restricted.pickle_module((), path, extra=_metadata_classes())
            with open(path, "rb") as handle:
                meta = module.load(handle)
            if getattr(meta, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader(str(src))


def _safe_planner() -> Any:
    """A load planner that reads DCP's non-tensor items with the restricted reader, not ``weights_only=False``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_objects(value.read(), file=f"DCP item {fqn}", trusted=False)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner()


def _check_sizes(src: Path, declared: int) -> None:
    """Refuse metadata declaring more tensor bytes than the DCP directory holds, before allocating."""
    on_disk = sum(f.stat().st_size for f in src.iterdir() if f.is_file() and not f.is_symlink())
    if declared > on_disk:
        raise CheckpointFormatError(f"{src}/.metadata declares {declared} tensor bytes but the directory holds only "
                                    f"{on_disk} bytes; the metadata is damaged or crafted, nothing was allocated.")


def export_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, verify: bool = True,
               progress: Callable[[int], None] | None = None) -> Path:
    """Write a checkpoint as a PyTorch DCP checkpoint at ``dst`` (a directory).

    Args:
        src: a checkpoint directory or root.
        dst: the DCP directory to create.
        verify: check hashes while reading.
        progress: called with the bytes of each tensor read.

    Returns:
        ``dst``.
    """
    ckpt = resolve(src)
    manifest = read_manifest(ckpt)
    state: dict[str, Any] = {}
    for full, entry in sorted(manifest.tensors.items()):
        state[full] = read_full(ckpt, manifest, entry, verify=verify)
        if progress is not None:
            progress(entry.nbytes)
    meta = {"kinds": {full: e.kind for full, e in manifest.tensors.items()}, "step": manifest.step,
            "layout": dataclasses.asdict(manifest.layout), "user_meta": manifest.user_meta,
            "objects": {rank: read_objects(ckpt, manifest, rank, verify=verify) for rank in manifest.objects}}
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    state[META_KEY] = buffer.getvalue()
    Path(dst).mkdir(parents=True, exist_ok=True)
    _dcp().save(state, checkpoint_id=str(dst), no_dist=True)
    return Path(dst)


def import_dcp(src: str | os.PathLike, dst_root: str | os.PathLike, *, step: int | None = None,
               progress: Callable[[int], None] | None = None) -> Path:
    """Convert a DCP checkpoint into a universal checkpoint under the root ``dst_root``.

    Args:
        src: the DCP directory.
        dst_root: the universal checkpoint root (the result is ``dst_root/step-<step>``).
        step: the step to record (default: the exported step, else 0).
        progress: called with the bytes of each tensor written.

    Returns:
        The committed checkpoint directory.
    """
    dcp = _dcp()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _safe_reader(src)
    metadata = reader.read_metadata()
    infos = metadata.state_dict_metadata.items()
    _check_sizes(Path(src), sum(math.prod(i.size) * i.properties.dtype.itemsize
                                for _, i in infos if isinstance(i, TensorStorageMetadata)))
    state: dict[str, Any] = {}
    for fqn, info in infos:
        if isinstance(info, TensorStorageMetadata):
            state[fqn] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        else:
            state[fqn] = None
    dcp.load(state, storage_reader=reader, planner=_safe_planner(), no_dist=True)
    meta: dict[str, Any] = {}
    if isinstance(state.get(META_KEY), bytes):
        meta = load_objects(state.pop(META_KEY), file=f"{src} item {META_KEY}", trusted=False)
    kinds = meta.get("kinds", {})
    objects = meta.get("objects") or {}
    extra = {fqn: value for fqn, value in state.items() if not isinstance(value, torch.Tensor)}
    if extra:
        objects = {rank: {**objs, **{f"dcp.{k}": v for k, v in extra.items()}} for rank, objs in objects.items()} \
            if objects else {0: {"dcp": extra}}

    place = _plait_place if kinds else _torch_place(state)

    def tensors():
        for fqn, value in state.items():
            if isinstance(value, torch.Tensor):
                key, name, kind = place(fqn)
                yield key, name, kinds.get(fqn, kind), value

    # The import is written by one process as whole tensors; the original layout is kept for reference.
    user_meta = {**(meta.get("user_meta") or {}), "imported_from": "dcp", "source_layout": meta.get("layout")}
    return write_offline(dst_root, step=meta.get("step", 0) if step is None else step, tensors=tensors(),
                         objects=objects, user_meta=user_meta, progress=progress)


def _plait_place(fqn: str) -> tuple[str, str, str]:
    """Key, name and default kind of a tensor filed as ``key/name`` (plait's DCP exports), or under key
    ``dcp`` with its own name (a bare torch ``state_dict``)."""
    key, name = fqn.split("/", 1) if "/" in fqn else ("dcp", fqn)
    return key, name, "parameter"


def _torch_place(state: dict[str, Any]) -> Callable[[str], tuple[str, str, str]]:
    """How to file the tensors of a DCP checkpoint torch wrote.

    ``get_state_dict(model, optim)`` saved as ``{"model": ..., "optim": ...}`` (the layout torch's
    docs and FSDP2 users write) flattens to ``model.<param>`` and ``optim.state.<param>.<field>``:
    the model's tensors become the parameters of key ``model`` under their own names (so an HF
    export loads with ``from_pretrained``), optimizer tensors become ``optimizer_state`` of key
    ``optim``, anything else is kept as ``other``. A checkpoint without ``model.`` names (a bare
    ``state_dict``) keeps every tensor as a parameter of key ``dcp``, under its own name.
    """
    if not any(fqn.startswith("model.") for fqn, v in state.items() if isinstance(v, torch.Tensor)):
        return _plait_place

    def place(fqn: str) -> tuple[str, str, str]:
        if fqn.startswith("model."):
            return "model", fqn[len("model."):], "parameter"
        if fqn.startswith("optim."):
            return "optim", fqn[len("optim."):], "optimizer_state"
        return "dcp", fqn, "other"
    return place
