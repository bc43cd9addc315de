"""State of a sharded model: full (consolidated) tensors, the sharded-state protocol, streaming export.

Semantics, once:

* ``model.state_dict()`` returns every parameter whole, as fp32 masters cast to the parameter's
  dtype, plus persistent buffers, on every rank (gathered unit by unit).
* ``model.load_state_dict(sd)`` takes whole tensors; each rank copies only its own slices into the
  masters and shards, so no communication happens.
* ``model.sharded_state_dict()`` / ``load_sharded_state_dict()`` implement
  :class:`plait.kernels.sharded_state.ShardedStateful` for masters, optimizer state and the loss
  scaler: flat ranges into each parameter, aliasing live storage, so plait-universal-ckpt can save
  at one layout and load into another.
* :func:`export_full_weights` writes a safetensors file while gathering one unit at a time: peak
  extra memory is one unit, never a second copy of the model. Empty tensors are never written.

A parameter that lives on some ranks only (an expert under expert parallelism, given an identity
by the parameter group's ``zero_global``) is saved, exported and loaded under its global name,
as rows of its global shape: the sharded state dict describes it as a flat range of the global
tensor, the export gathers every rank's part, and ``load_state_dict`` takes the global tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.sharded_state import ShardedTensor, ShardSpec
from plait.zero_sharding.composition import extension_objects
from plait.zero_sharding.units import FlatUnit

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


@torch.no_grad()
def gather_unit_masters(engine: Any, unit: FlatUnit) -> torch.Tensor:
    """The unit's whole padded flat fp32 master (one all-gather over the unit's group)."""
    shard = torch.empty(unit.shard_numel, dtype=torch.float32, device=unit.device)
    engine.placement.read_master(unit.key, shard)
    full = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.device)
    collectives.all_gather_into_tensor(full, shard, group=unit.group)
    return full


@torch.no_grad()
def iter_full_parameters(engine: Any, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, whole tensor)`` per parameter, gathering one unit at a time (collective:
    every rank of each unit's group must iterate).

    Args:
        engine: the model's engine.
        dtype: output dtype; ``None`` means fp32 masters.
    """
    for unit in engine.units:
        flat = gather_unit_masters(engine, unit)
        for slot in unit.slots:
            value = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
            yield slot.name, value.to(device="cpu", dtype=dtype or torch.float32, copy=True)
        del flat


@torch.no_grad()
def load_full_parameters(engine: Any, state: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
    """Copy whole tensors into this rank's masters and shards (no communication).

    Returns:
        Parameter names missing from ``state``.

    Raises:
        KeyError: ``strict`` and a parameter is missing.
        ValueError: a tensor's shape differs from the parameter's.
    """
    missing = []
    masters = engine.placement.masters()
    for unit in engine.units:
        lo, hi = unit.shard_range
        master = masters[unit.key]
        for slot in unit.slots:
            name = slot.global_name if slot.global_name in state else slot.name
            if name not in state:
                missing.append(slot.global_name)
                continue
            value = state[name]
            expected = slot.global_shape if name == slot.global_name else slot.shape
            if tuple(value.shape) != expected:
                raise ValueError(f"load_state_dict: {name!r} has shape {tuple(value.shape)}, the model "
                                 f"expects {expected}; load a checkpoint of the same architecture.")
            flat = value.reshape(-1)
            if name == slot.global_name and not slot.is_global:
                flat = flat[slot.global_offset:slot.global_offset + slot.numel]  # this rank's rows
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < stop:
                master[start - lo:stop - lo].copy_(flat[start - slot.offset:stop - slot.offset])
            if unit.resident or unit.gathered:
                unit.full[slot.offset:slot.offset + slot.numel].copy_(flat)
        if not unit.resident:
            unit.load_from_master(engine.placement)
    if strict and missing:
        raise KeyError(f"load_state_dict: missing parameters {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                       "pass strict=False to keep their current values.")
    return missing


def _holders(engine: Any, unit: FlatUnit, start: int, stop: int) -> tuple[int, ...]:
    """Global ranks holding the flat range ``[start, stop)`` of ``unit`` (this group only)."""
    ranks = dist.get_process_group_ranks(unit.group)
    out = []
    for index, rank in enumerate(ranks):
        lo, hi = index * unit.shard_numel, (index + 1) * unit.shard_numel
        if max(lo, start) < min(hi, stop):
            out.append(rank)
    return tuple(out) or (dist.get_rank(),)


def ensure_optimizer_state(optimizer: Any) -> None:
    """Create the inner optimizer's state (so it can be aliased and loaded into) with a step of
    zero gradients at learning rate 0, then reset step counters to 0."""
    inner = optimizer.inner
    masters = [p for g in inner.param_groups for p in g["params"]]
    if all(p in inner.state and inner.state[p] for p in masters):
        return
    saved = [g["lr"] for g in inner.param_groups]
    with torch.no_grad():
        for g in inner.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        for p in masters:
            p.grad = torch.zeros_like(p)
        inner.step()
        for p in masters:
            p.grad = None
        for g, lr in zip(inner.param_groups, saved):
            g["lr"] = lr
        for p in masters:
            step = inner.state[p].get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                inner.state[p]["step"] = 0


def sharded_state_dict(engine: Any, optimizer: Any) -> dict[str, ShardedTensor]:
    """Masters, optimizer state and loss scaler as described pieces (see the module docstring)."""
    ensure_optimizer_state(optimizer)
    out: dict[str, ShardedTensor] = {}
    masters = engine.placement.masters()
    for unit in engine.units:
        master = masters[unit.key]
        state = optimizer.inner.state.get(master, {})
        for slot, (plo, phi), (slo, shi) in unit.local_pieces():
            # A parameter's step counter is shared by every rank holding any piece of it, so the
            # holders are those of the whole parameter, not of this rank's piece.
            holders = _holders(engine, unit, slot.offset, slot.offset + slot.numel)
            base = slot.global_offset  # global identity: rows of a larger tensor (experts under EP)
            spec = dict(global_shape=slot.global_shape, flat_range=(base + plo, base + phi),
                        replica_ranks=(dist.get_rank(),))
            out[f"model.{slot.global_name}"] = ShardedTensor(
                ShardSpec(name=f"model.{slot.global_name}", kind="parameter", dtype=torch.float32, **spec),
                master.detach()[slo:shi])
            for state_name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                name = f"optim.{state_name}.{slot.global_name}"
                if value.shape == master.shape:
                    out[name] = ShardedTensor(
                        ShardSpec(name=name, kind="optimizer_state", dtype=value.dtype, **spec), value[slo:shi])
                elif value.numel() == 1:
                    # Step counters are one per master; every parameter piece names (aliases) it.
                    # A flat-range spec describes a 0-d tensor's piece as 1-D, hence view(1).
                    spec_full = ShardSpec.full(name, value.view(()), kind="optimizer_state", replica_ranks=holders)
                    out[name] = ShardedTensor(spec_full, value.view(1))
    for obj in extension_objects(engine):
        if hasattr(obj, "sharded_state_dict"):
            pieces = obj.sharded_state_dict()
            odd = [name for name in pieces if not name.startswith("ext.") or name in out]
            if odd:
                raise ValueError(f"{type(obj).__name__}.sharded_state_dict() names {odd[:3]}: extension pieces must "
                                 "start with 'ext.' and be unique; rename them.")
            out.update(pieces)
    scaler = optimizer.scaler.as_tensor()
    out["zero.loss_scaler"] = ShardedTensor(ShardSpec.full("zero.loss_scaler", scaler, kind="other",
                                                           replica_ranks=tuple(range(dist.get_world_size()))), scaler)
    return out


@torch.no_grad()
def load_sharded_state_dict(engine: Any, optimizer: Any, state: dict[str, ShardedTensor]) -> None:
    """After a consumer filled the pieces in place: refresh shards and parameters from the masters
    and restore the loss scaler."""
    if "zero.loss_scaler" in state:
        scale, good, hysteresis, skipped = state["zero.loss_scaler"].local.tolist()
        optimizer.scaler.load_state_dict({"scale": scale, "good_steps": good, "hysteresis_left": hysteresis,
                                          "skipped_steps": skipped})
    for unit in engine.units:
        unit.refresh_from_master(engine.placement, engine.gatherer)
    engine.settle_shards()
    extension_pieces = {name: piece for name, piece in state.items() if name.startswith("ext.")}
    for obj in extension_objects(engine):
        if hasattr(obj, "load_sharded_state_dict"):
            obj.load_sharded_state_dict(extension_pieces)


def _safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "plait.zero_sharding"}}
    offset = 0
    for name, dtype, shape in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def spread(unit: FlatUnit, world: int) -> bool:
    """Whether ``unit`` holds parameters that differ across its groups (experts under EP)."""
    return unit.replicas == 1 and unit.group_size < world


@torch.no_grad()
def _spread_pieces(engine: Any, units: list[FlatUnit]) -> tuple[list[tuple[str, tuple[int, ...], int, int, int]],
                                                                 dict[tuple[str, int], torch.Tensor]]:
    """Every rank's parts of the global tensors that live on some ranks only: ``(global name,
    global shape, flat offset, numel, source rank)`` sorted, the same list on every rank, and this
    rank's own values. One rank per sharding group contributes (the others hold the same)."""
    mine: list[tuple[str, tuple[int, ...], int, int]] = []
    values: dict[tuple[str, int], torch.Tensor] = {}
    for unit in units:
        flat = gather_unit_masters(engine, unit)  # collective over the unit's group
        if unit.group_rank == 0:
            for slot in unit.slots:
                mine.append((slot.global_name, slot.global_shape, slot.global_offset, slot.numel))
                values[(slot.global_name, slot.global_offset)] = flat[slot.offset:slot.offset + slot.numel].cpu()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # metadata only; tensors go through the counted collectives
    pieces = sorted((name, tuple(shape), offset, numel, rank) for rank, theirs in enumerate(everyone)
                    for name, shape, offset, numel in theirs)
    covered: dict[str, int] = {}
    for (name, _shape, offset, numel, rank), nxt in zip(pieces, [*pieces[1:], None]):
        if nxt is not None and nxt[0] == name and nxt[2] < offset + numel:
            raise ValueError(f"export_full_weights: ranks {rank} and {nxt[4]} both hold {name!r} at element "
                             f"{nxt[2]}; give the parameter group zero_global=(name, shape) -> (global name, global "
                             "shape, row offset) so parameters that differ across ranks have distinct identities.")
        covered[name] = covered.get(name, 0) + numel
    short = [n for n, shape, *_ in pieces if covered[n] != math.prod(shape)]
    if short:
        raise ValueError(f"export_full_weights: the ranks hold only part of {sorted(set(short))[:3]}; "
                         "check zero_global's global shapes and offsets.")
    return pieces, values


def export_full_weights(model: Any, path: str | Path, *, dtype: torch.dtype | None = None) -> Path | None:
    """Write the consolidated weights (parameters + persistent buffers) as one safetensors file,
    streaming tensor by tensor. Collective: call on every rank; rank 0 writes. Parameters that
    live on some ranks only (experts under expert parallelism) are written whole under their
    global names, each rank sending its part to rank 0 one global tensor at a time.

    Args:
        model: a sharded model.
        path: destination file.
        dtype: parameter dtype in the file (``None``: fp32 masters).

    Returns:
        The path on rank 0, ``None`` elsewhere.

    Raises:
        ValueError: parameters differing across ranks share a global identity, or leave part of
            a global tensor uncovered (on every rank, before anything is written).
    """
    engine = model.zero_engine
    world, rank, out_dtype = dist.get_world_size(), dist.get_rank(), dtype or torch.float32
    dense = [u for u in engine.units if not spread(u, world)]
    pieces, values = _spread_pieces(engine, [u for u in engine.units if spread(u, world)])
    shapes = {name: shape for name, shape, *_ in pieces}
    entries = [(s.name, out_dtype, s.shape) for u in dense for s in u.slots if s.numel]
    entries += [(name, out_dtype, shape) for name, shape in shapes.items() if math.prod(shape)]
    buffers = {name: b for name, b in model.named_buffers() if name in model.persistent_buffer_names() and b.numel()}
    entries += [(name, b.dtype, tuple(b.shape)) for name, b in buffers.items()]
    path = Path(path)
    handle = open(path, "wb") if rank == 0 else None  # noqa: SIM115 - closed below, after streaming
    try:
        if handle is not None:
            handle.write(_safetensors_header(entries))
        for unit in dense:
            flat = gather_unit_masters(engine, unit)
            for slot in unit.slots:
                if handle is not None and slot.numel:
                    _write(handle, flat[slot.offset:slot.offset + slot.numel].to(out_dtype))
        for name, shape in shapes.items():
            whole = torch.empty(math.prod(shape)) if rank == 0 else None
            for _name, _shape, offset, numel, src in (p for p in pieces if p[0] == name):
                part = values.get((name, offset)) if src == rank else None
                if whole is not None:
                    if src != 0:
                        part = torch.empty(numel)
                        collectives.recv(part, src=src)
                    whole[offset:offset + numel].copy_(part)
                elif part is not None:
                    collectives.send(part, dst=0)
            if handle is not None and whole is not None and whole.numel():
                _write(handle, whole.to(out_dtype))
        if handle is not None:
            for tensor in buffers.values():
                _write(handle, tensor.detach())
    finally:
        if handle is not None:
            handle.close()
    return path if rank == 0 else None


def _write(handle: Any, tensor: torch.Tensor) -> None:
    handle.write(tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes())
