"""Parity helpers for distributed tests: compare against a reference, check replicas agree."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and shape included), for bitwise comparisons."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """One SHA-256 over a name -> tensor mapping, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(tensor_digest(state[name]).encode())
    return h.hexdigest()


def assert_close_maps(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *,
                      rtol: float, atol: float, what: str = "tensor") -> None:
    """Same keys, and every tensor close; the error names the first key that is not."""
    missing, extra = set(expected) - set(actual), set(actual) - set(expected)
    if missing or extra:
        raise AssertionError(f"{what} keys differ: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for name in sorted(expected):
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{what} {n!r}: {m}")


def assert_replicas_equal(tensor: torch.Tensor, *, group: object | None = None, name: str = "tensor") -> None:
    """Every rank of ``group`` holds bitwise the same ``tensor`` (compared by digest)."""
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, tensor_digest(tensor), group=group)
    if len(set(digests)) != 1:
        raise AssertionError(f"{name} differs across ranks: digests {digests}")
