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
"""

from __future__ import annotations

import json
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
            if slot.name not in state:
                missing.append(slot.name)
                continue
            value = state[slot.name]
            if tuple(value.shape) != slot.shape:
                raise ValueError(f"load_state_dict: {slot.name!r} has shape {tuple(value.shape)}, the model "
                                 f"expects {slot.shape}; load a checkpoint of the same architecture.")
            flat = value.reshape(-1)
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
            spec = dict(global_shape=slot.shape, flat_range=(plo, phi), replica_ranks=(dist.get_rank(),))
            out[f"model.{slot.name}"] = ShardedTensor(
                ShardSpec(name=f"model.{slot.name}", kind="parameter", dtype=torch.float32, **spec),
                master.detach()[slo:shi])
            for state_name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                name = f"optim.{state_name}.{slot.name}"
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


def export_full_weights(model: Any, path: str | Path, *, dtype: torch.dtype | None = None) -> Path | None:
    """Write the consolidated weights (parameters + persistent buffers) as one safetensors file,
    streaming tensor by tensor. Collective: call on every rank; rank 0 writes.

    Args:
        model: a sharded model.
        path: destination file.
        dtype: parameter dtype in the file (``None``: fp32 masters).

    Returns:
        The path on rank 0, ``None`` elsewhere.
    """
    engine = model.zero_engine
    param_entries = [(s.name, dtype or torch.float32, s.shape) for u in engine.units for s in u.slots if s.numel]
    buffers = {name: b for name, b in model.named_buffers() if name in model.persistent_buffer_names() and b.numel()}
    entries = param_entries + [(name, b.dtype, tuple(b.shape)) for name, b in buffers.items()]
    writer = dist.get_rank() == 0
    path = Path(path)
    handle = open(path, "wb") if writer else None  # noqa: SIM115 - closed below, after streaming
    try:
        if handle is not None:
            handle.write(_safetensors_header(entries))
        for _name, tensor in iter_full_parameters(engine, dtype=dtype):
            if handle is not None and tensor.numel():
                handle.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        if handle is not None:
            for tensor in buffers.values():
                handle.write(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    finally:
        if handle is not None:
            handle.close()
    return path if writer else None
