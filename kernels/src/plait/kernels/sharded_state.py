"""The sharded-state protocol: how any plait feature describes the state it holds.

A producer (ZeRO, MoE, sequence parallelism, ...) describes every tensor it holds as a
:class:`ShardedTensor`: the local piece plus a :class:`ShardSpec` saying which global tensor it
belongs to, what part of it this rank holds (a flat range of the row-major flattened tensor, or
per-dimension slices) and which ranks hold the same piece. A consumer such as
plait-universal-ckpt saves and reshards through this description alone, without importing the
producer. Loading follows the DCP pattern: the *target* layout produces its own sharded state
dict (local tensors that alias live storage), the consumer fills those tensors in place, then
calls ``load_sharded_state_dict`` so the producer can refresh anything derived from them.

A state dict maps a key to a :class:`ShardedTensor`; the key is the spec's ``name``, except that a
rank holding several disjoint pieces of one tensor (a tensor-parallel shard of a fused
``[q|k|v]`` weight is three boxes of the consolidated tensor) keys them ``piece_key(name, i)``
with the same ``spec.name``. Consumers identify tensors by ``spec.name``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable

import torch

KINDS = ("parameter", "gradient", "optimizer_state", "buffer", "other")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """Which piece of which global tensor a rank holds.

    Exactly one of ``flat_range`` and ``slices`` is set (an unsharded tensor uses a flat range
    covering everything; see :meth:`full`).

    Attributes:
        name: the tensor's global name, unique within a state dict, e.g.
            ``"model.layers.0.mlp.up.weight"`` or ``"optim.exp_avg.model.layers.0.mlp.up.weight"``.
        kind: one of ``parameter``, ``gradient``, ``optimizer_state``, ``buffer``, ``other``.
        global_shape: the shape of the whole tensor.
        dtype: element type of the whole tensor (the local piece has the same dtype).
        flat_range: ``(start, stop)`` into the row-major flattening of the global tensor.
        slices: per-dimension ``(start, stop)``; len equals ``len(global_shape)``.
        replica_ranks: global ranks holding this identical piece, this rank included; the
            lowest one is the designated writer.
        pattern: optional JSON-able description of how the consolidated tensor maps to
            model-parallel pieces (plait-universal-ckpt's layout language: split dimension,
            fused parts, vocabulary padding, ...); recorded in checkpoints for people and tools,
            never needed to read the piece back.
    """

    name: str
    kind: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    flat_range: tuple[int, int] | None = None
    slices: tuple[tuple[int, int], ...] | None = None
    replica_ranks: tuple[int, ...] = (0,)
    pattern: dict | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ShardSpec.kind={self.kind!r} for {self.name!r}; use one of {KINDS}.")
        if (self.flat_range is None) == (self.slices is None):
            raise ValueError(f"ShardSpec {self.name!r}: set exactly one of flat_range and slices.")
        if not self.replica_ranks:
            raise ValueError(f"ShardSpec {self.name!r}: replica_ranks must name at least this rank.")
        if self.flat_range is not None:
            start, stop = self.flat_range
            if not 0 <= start <= stop <= self.global_numel:
                raise ValueError(
                    f"ShardSpec {self.name!r}: flat_range={self.flat_range} is outside "
                    f"[0, {self.global_numel}] for global_shape={self.global_shape}."
                )
        else:
            if len(self.slices) != len(self.global_shape):
                raise ValueError(
                    f"ShardSpec {self.name!r}: slices has {len(self.slices)} dims, global_shape "
                    f"{self.global_shape} has {len(self.global_shape)}; give one (start, stop) per dim."
                )
            for dim, ((start, stop), size) in enumerate(zip(self.slices, self.global_shape)):
                if not 0 <= start <= stop <= size:
                    raise ValueError(
                        f"ShardSpec {self.name!r}: slices[{dim}]=({start}, {stop}) is outside [0, {size}]."
                    )

    @classmethod
    def full(cls, name: str, tensor: torch.Tensor, *, kind: str = "parameter",
             replica_ranks: tuple[int, ...] = (0,)) -> ShardSpec:
        """Spec for an unsharded tensor held whole (replicated on ``replica_ranks``)."""
        return cls(name=name, kind=kind, global_shape=tuple(tensor.shape), dtype=tensor.dtype,
                   flat_range=(0, tensor.numel()), replica_ranks=replica_ranks)

    @property
    def global_numel(self) -> int:
        """Number of elements of the whole tensor."""
        return math.prod(self.global_shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local piece: 1-D for flat ranges, the slice extents otherwise."""
        if self.flat_range is not None:
            return (self.flat_range[1] - self.flat_range[0],)
        return tuple(stop - start for start, stop in self.slices)

    @property
    def local_numel(self) -> int:
        """Number of elements this rank holds."""
        return math.prod(self.local_shape)

    @property
    def writer_rank(self) -> int:
        """The one rank that writes this piece when saving (lowest replica)."""
        return min(self.replica_ranks)

    def index_into(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """The view of ``global_tensor`` (shaped ``global_shape``) that this piece covers."""
        if tuple(global_tensor.shape) != self.global_shape:
            raise ValueError(
                f"{self.name!r}: tensor shape {tuple(global_tensor.shape)} != global_shape {self.global_shape}."
            )
        if self.flat_range is not None:
            return global_tensor.reshape(-1)[self.flat_range[0]:self.flat_range[1]]
        return global_tensor[tuple(slice(start, stop) for start, stop in self.slices)]


@dataclasses.dataclass(frozen=True)
class ShardedTensor:
    """A local piece and its description.

    Attributes:
        spec: what the piece is.
        local: the piece itself, shaped ``spec.local_shape``; for a producer's state dict it
            aliases live storage so a consumer can load by copying into it.
    """

    spec: ShardSpec
    local: torch.Tensor

    def __post_init__(self) -> None:
        if tuple(self.local.shape) != self.spec.local_shape:
            raise ValueError(
                f"{self.spec.name!r}: local shape {tuple(self.local.shape)} != spec.local_shape "
                f"{self.spec.local_shape}."
            )
        if self.local.dtype != self.spec.dtype:
            raise ValueError(f"{self.spec.name!r}: local dtype {self.local.dtype} != spec dtype {self.spec.dtype}.")


@runtime_checkable
class ShardedStateful(Protocol):
    """Anything whose distributed state a checkpoint can save and reshard.

    ``sharded_state_dict()`` returns name -> :class:`ShardedTensor` for every tensor held
    (pieces alias live storage). ``load_sharded_state_dict(state)`` is called after the
    consumer has filled those pieces, with the same dict, so the producer can refresh derived
    copies (e.g. low-precision parameters from fp32 masters).
    """

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """Every tensor this object holds, described."""

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """Accept pieces filled in place by a consumer."""


def piece_key(name: str, index: int) -> str:
    """State-dict key of a rank's ``index``-th piece of tensor ``name`` when it holds several
    (index 0 keeps the plain name, so a single piece is keyed as before)."""
    return name if index == 0 else f"{name}#{index}"


def flat_overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Intersection of two flat ranges, or ``None`` when they do not overlap."""
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def even_flat_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The flat range rank ``rank`` of ``world_size`` holds when ``numel`` is split as evenly as
    possible with padding at the end (ZeRO's layout: ceil-sized chunks, the last ones short or empty).
    """
    chunk = -(-numel // world_size)
    start = min(numel, rank * chunk)
    return start, min(numel, start + chunk)
