"""A plait universal checkpoint as the ``(name, tensor)`` stream vLLM's ``model.load_weights`` takes.

No vLLM import here, so this part is tested without vLLM. Names: the checkpoint stores a model
under one top-level key (``model`` by default); ZeRO producers (plait-zero-sharding) keep its
parameters as ``model.<name>`` and buffers as ``buffer.<name>``, other producers keep the model's
own ``state_dict`` names. Either way the stream carries the HF ``state_dict`` names, which is
what vLLM's ``load_weights`` maps onto its fused layers (qkv, gate|up) and tensor-parallel slices.
Every tensor is consolidated from whatever pieces the producer's layout stored and checked against
the manifest's chunk hashes as it is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from plait.universal_ckpt.directory import resolve
from plait.universal_ckpt.errors import CheckpointIntegrityError, CheckpointLayoutError
from plait.universal_ckpt.interop.hf import ZERO_MARKER, model_name
from plait.universal_ckpt.manifest import Manifest, TensorEntry
from plait.universal_ckpt.reader import check_files, read_full, read_manifest

WEIGHT_KINDS = ("parameter", "buffer")


class CheckpointWeights:
    """The model weights of one universal checkpoint, read lazily.

    Args:
        path: a checkpoint directory (holds ``manifest.json``) or a checkpoint root (its latest
            committed step is used).
        key: the top-level key holding the model (default: the only key holding parameters).
        verify: check every chunk hash while reading (default True).

    Raises:
        CheckpointNotFoundError: no plait checkpoint at ``path``.
        CheckpointFormatError: a damaged or newer-format manifest.
        CheckpointIntegrityError: a data file is missing or has the wrong size (names the file).
        CheckpointLayoutError: no key holds parameters, or several do and ``key`` is not given.
    """

    def __init__(self, path: str | os.PathLike, *, key: str | None = None, verify: bool = True) -> None:
        self.directory: Path = resolve(path)
        self.manifest: Manifest = read_manifest(self.directory)
        check_files(self.directory, self.manifest)  # stat only: a truncated file fails before any read
        self.key = self._pick_key(key)
        self.verify = verify
        self._zero = f"{self.key}/{ZERO_MARKER}" in self.manifest.tensors

    def _pick_key(self, key: str | None) -> str:
        keys = sorted({e.key for e in self.manifest.tensors.values() if e.kind == "parameter"})
        if key is None:
            if len(keys) != 1:
                raise CheckpointLayoutError(
                    f"{self.directory}: parameters live under keys {keys or 'none'}; pass "
                    "model_loader_extra_config={'key': <one of them>} to say which one is the model.")
            return keys[0]
        if key not in keys:
            raise CheckpointLayoutError(f"{self.directory}: key {key!r} holds no parameters; keys with "
                                        f"parameters: {keys}. Fix model_loader_extra_config['key'].")
        return key

    def entries(self) -> list[TensorEntry]:
        """The model's parameter and buffer entries, sorted by name."""
        return sorted((e for e in self.manifest.tensors.values() if e.key == self.key and e.kind in WEIGHT_KINDS),
                      key=lambda e: e.name)

    def name_of(self, entry: TensorEntry) -> str:
        """The model's own ``state_dict`` name of ``entry`` (the ZeRO producer's prefix removed)."""
        return model_name(entry.name, entry.kind, zero=self._zero)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(state_dict name, consolidated tensor)`` one tensor at a time.

        Raises:
            CheckpointIntegrityError: a chunk's hash differs from the manifest's. The message names
                the file, the checkpoint directory and the fix.
        """
        for entry in self.entries():
            try:
                tensor = read_full(self.directory, self.manifest, entry, verify=self.verify)
            except CheckpointIntegrityError as exc:
                raise CheckpointIntegrityError(
                    f"plait_universal: checkpoint file {exc.file} in {self.directory} is corrupt ({exc}); "
                    f"while reading {entry.full_name}. Restore the file from a good copy or re-save the checkpoint.",
                    file=exc.file, expected=exc.expected, actual=exc.actual) from exc
            yield self.name_of(entry), tensor

    def __len__(self) -> int:
        return len(self.entries())
