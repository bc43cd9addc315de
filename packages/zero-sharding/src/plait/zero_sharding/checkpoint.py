"""State of a sharded model: full (consolidated) tensors, the sharded-state protocol, streaming export.

Semantics, once:

* ``model.state_dict()`` returns every parameter whole, as fp32 masters cast to the parameter's
  dtype, plus persistent buffers, on every rank (gathered unit by unit). Parameters that live on
  some ranks only come last, under their global names (below), the same tensors on every rank.
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
tensor, the export gathers every rank's part to rank 0, ``state_dict()`` broadcasts every part to
every rank, and ``load_state_dict`` takes the global tensors (each rank copies its own rows). A
group that differs across ranks without ``zero_global`` keeps rank-local names in
``state_dict()`` (each rank its own parameters: a per-rank state) and is refused by the export
and the sharded state dict (whose pieces would describe the same elements with different values).
"""

from __future__ import annotations

import dataclasses
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
from plait.kernels.state_names import tied_aliases
from plait.zero_sharding.composition import extension_objects
from plait.zero_sharding.low_precision import refuse_sharded_state
from plait.zero_sharding.tensor_parallel import is_dtensor
from plait.zero_sharding.tensor_parallel_state import full_value, local_part, tp_pieces
from plait.zero_sharding.units import FlatUnit
from plait.zero_sharding.whole_tensor import restore_whole_scalars, whole_state_pieces

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
def iter_full_parameters(engine: Any, *, dtype: torch.dtype | None = None,
                         parameter_dtype: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, whole tensor)`` per parameter, gathering one unit at a time (collective:
    every rank of each unit's group must iterate, and every rank of the world when some
    parameters live on some ranks only). Those (experts under expert parallelism, given an
    identity by ``zero_global``) come last, whole under their global names, sorted by name.

    Args:
        engine: the model's engine.
        dtype: output dtype; ``None`` means fp32 masters.
        parameter_dtype: each tensor in its parameter's dtype instead (``dtype`` ignored).

    Raises:
        ValueError: identities given by ``zero_global`` collide or leave a global tensor uncovered.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    spread_units = [u for u in engine.units if spread(u, world)]
    for unit in engine.units:
        if spread(unit, world):
            continue
        flat = gather_unit_masters(engine, unit)
        for slot in unit.slots:
            value = full_value(slot.param, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
            out_dtype = slot.param.dtype if parameter_dtype else dtype or torch.float32
            yield slot.name, value.to(device="cpu", dtype=out_dtype, copy=True)
        del flat
    if spread_units:
        for name, value, param_dtype in iter_global_parameters(engine, spread_units):
            yield name, value.to(dtype=param_dtype if parameter_dtype else dtype or torch.float32)


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
            if is_dtensor(slot.param):  # a whole tensor; this rank keeps its TP shard of it
                expected = tuple(slot.param.shape)
            if tuple(value.shape) != expected:
                raise ValueError(f"load_state_dict: {name!r} has shape {tuple(value.shape)}, the model "
                                 f"expects {expected}; load a checkpoint of the same architecture.")
            flat = local_part(slot.param, value).reshape(-1)
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
    """Masters, optimizer state and loss scaler as described pieces (see the module docstring).
    Collective (one exchange of names over the world) when some parameters live on some ranks
    only: their pieces must describe distinct parts of global tensors, else a checkpoint would
    keep one rank's experts in place of another's.

    Raises:
        ValueError: parameters that differ across ranks share a name and elements (a group without
            ``zero_global``), or their identities leave part of a global tensor uncovered; or the
            optimizer keeps state the layout cannot name (compact low-precision states, a
            whole-tensor optimizer's factored moments of a piece of a larger global tensor).
    """
    refuse_sharded_state(optimizer, "sharded_state_dict")
    world = dist.get_world_size() if dist.is_initialized() else 1
    spread_units = [u for u in engine.units if spread(u, world)]
    if spread_units:  # the same answer on every rank
        spread_pieces(engine, spread_units, values=False).check("sharded_state_dict")
    ensure_optimizer_state(optimizer)
    whole = getattr(engine.placement, "whole_tensor", False)  # state per whole tensor on its owner
    out: dict[str, ShardedTensor] = whole_state_pieces(engine.placement, optimizer.inner) if whole else {}
    masters = engine.placement.masters()
    for unit in engine.units:
        master = masters[unit.key]
        state = {} if whole else optimizer.inner.state.get(master, {})
        for slot, (plo, phi), (slo, shi) in unit.local_pieces():
            # A parameter's step counter is shared by every rank holding any piece of it, so the
            # holders are those of the whole parameter, not of this rank's piece.
            holders = _holders(engine, unit, slot.offset, slot.offset + slot.numel)
            if is_dtensor(slot.param):  # a TP shard: boxes of the global tensor
                out.update(_tp_slot_pieces(slot, master.detach(), state, (plo, phi), (slo, shi), holders))
                continue
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


def _tp_slot_pieces(slot: Any, master: torch.Tensor, state: dict[str, Any], param_range: tuple[int, int],
                    shard_range: tuple[int, int], holders: tuple[int, ...]) -> dict[str, ShardedTensor]:
    """Master and optimizer-state pieces of one tensor-parallel parameter (see
    :mod:`.tensor_parallel_state`); step counters as for any parameter."""
    slo, shi = shard_range
    out = tp_pieces(f"model.{slot.global_name}", "parameter", slot.param, master[slo:shi], param_range)
    for state_name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        name = f"optim.{state_name}.{slot.global_name}"
        if value.shape == master.shape:
            out.update(tp_pieces(name, "optimizer_state", slot.param, value[slo:shi], param_range))
        elif value.numel() == 1:
            spec_full = ShardSpec.full(name, value.view(()), kind="optimizer_state", replica_ranks=holders)
            out[name] = ShardedTensor(spec_full, value.view(1))
    return out


@torch.no_grad()
def load_sharded_state_dict(engine: Any, optimizer: Any, state: dict[str, ShardedTensor]) -> None:
    """After a consumer filled the pieces in place: refresh shards and parameters from the masters
    and restore the loss scaler."""
    if "zero.loss_scaler" in state:
        scale, good, hysteresis, skipped = state["zero.loss_scaler"].local.tolist()
        optimizer.scaler.load_state_dict({"scale": scale, "good_steps": good, "hysteresis_left": hysteresis,
                                          "skipped_steps": skipped})
    if getattr(engine.placement, "whole_tensor", False):
        restore_whole_scalars(engine.placement)  # number-valued state (Adafactor's step) back to numbers
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


@dataclasses.dataclass
class SpreadPieces:
    """Every rank's parts of the tensors that live on some ranks only, the same on every rank.

    Attributes:
        pieces: ``(global name, global shape, flat offset, numel, source rank)`` sorted; one rank
            per sharding group contributes (the others hold the same).
        dtypes: global name -> the parameter's dtype.
        colliding: global names that two groups hold at the same elements, mapped to whether any
            of them was given an identity by ``zero_global`` (``False``: a group without one,
            whose parameters keep rank-local names).
        values: this rank's own parts, ``(global name, flat offset) -> fp32 values``.
        local: ``(local name, global name, flat offset, local shape)`` of this rank's
            parameters (only with ``keep_all``).
    """

    pieces: list[tuple[str, tuple[int, ...], int, int, int]]
    dtypes: dict[str, torch.dtype]
    colliding: dict[str, bool]
    values: dict[tuple[str, int], torch.Tensor]
    local: list[tuple[str, str, int, tuple[int, ...]]]

    def check(self, what: str, *, allow_local: bool = False) -> None:
        """Raise unless every global tensor is covered exactly once (``allow_local``: except the
        colliding names no identity was given to, which stay rank-local).

        Raises:
            ValueError: two groups hold the same elements of a global tensor, or part of one is
                held by no rank.
        """
        bad = sorted(n for n, identified in self.colliding.items() if identified or not allow_local)
        if bad:
            raise ValueError(f"{what}: several ranks hold {bad[:3]} at the same elements; give the parameter group "
                             "zero_global=(name, shape) -> (global name, global shape, row offset) so parameters "
                             "that differ across ranks have distinct identities.")
        covered: dict[str, int] = {}
        for name, _shape, _offset, numel, _rank in self.pieces:
            covered[name] = covered.get(name, 0) + numel
        short = sorted({n for n, shape, *_ in self.pieces
                        if n not in self.colliding and covered[n] != math.prod(shape)})
        if short:
            raise ValueError(f"{what}: the ranks hold only part of {short[:3]}; check zero_global's global shapes "
                             "and offsets.")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Global name -> global shape of the tensors covered exactly once, in sorted order."""
        return {name: shape for name, shape, *_ in self.pieces if name not in self.colliding}


@torch.no_grad()
def spread_pieces(engine: Any, units: list[FlatUnit], *, keep_all: bool = False,
                  values: bool = True) -> SpreadPieces:
    """Gather ``units`` (each over its own group) and exchange which rank holds which part of
    which global tensor (metadata only: one ``all_gather_object`` over the world).

    Args:
        engine: the model's engine.
        units: the units holding parameters that differ across groups (:func:`spread`).
        keep_all: keep this rank's values of every unit (not only where it is its group's rank 0).
        values: gather the units' values at all (``False``: the metadata exchange alone).
    """
    mine: list[tuple[str, tuple[int, ...], int, int, bool, str]] = []
    own: dict[tuple[str, int], torch.Tensor] = {}
    local: list[tuple[str, str, int, tuple[int, ...]]] = []
    for unit in units:
        flat = gather_unit_masters(engine, unit) if values else None  # collective over the unit's group
        for slot in unit.slots:
            if unit.group_rank == 0:
                mine.append((slot.global_name, slot.global_shape, slot.global_offset, slot.numel,
                             not slot.is_global, str(slot.param.dtype).removeprefix("torch.")))
            if flat is not None and (unit.group_rank == 0 or keep_all):
                own[(slot.global_name, slot.global_offset)] = flat[slot.offset:slot.offset + slot.numel].cpu()
            if keep_all:
                local.append((slot.name, slot.global_name, slot.global_offset, slot.shape))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # metadata only; tensors go through the counted collectives
    rows = sorted((name, tuple(shape), offset, numel, rank, identified, dtype)
                  for rank, theirs in enumerate(everyone) for name, shape, offset, numel, identified, dtype in theirs)
    colliding: dict[str, bool] = {}
    for row, nxt in zip(rows, [*rows[1:], None]):
        if nxt is not None and nxt[0] == row[0] and nxt[2] < row[2] + row[3]:
            colliding[row[0]] = colliding.get(row[0], False) or row[5] or nxt[5]
    return SpreadPieces(pieces=[row[:5] for row in rows], dtypes={row[0]: getattr(torch, row[6]) for row in rows},
                        colliding=colliding, values=own, local=local)


@torch.no_grad()
def iter_global_parameters(engine: Any, units: list[FlatUnit]) -> Iterator[tuple[str, torch.Tensor, torch.dtype]]:
    """Yield ``(global name, whole fp32 tensor, the parameter's dtype)`` for the parameters of
    ``units`` that live on some ranks only, on every rank (each part broadcast from a rank holding
    it), sorted by name; a parameter group without ``zero_global`` whose names collide across
    ranks yields this rank's own tensors under their local names instead (its state is per rank).
    Collective over the world.

    Raises:
        ValueError: identities given by ``zero_global`` collide or leave a global tensor uncovered.
    """
    spread_state = spread_pieces(engine, units, keep_all=True)
    spread_state.check("state_dict", allow_local=True)
    rank = dist.get_rank()
    for name, shape in spread_state.shapes().items():
        whole = torch.empty(math.prod(shape))
        for _name, _shape, offset, numel, src in (p for p in spread_state.pieces if p[0] == name):
            part = spread_state.values[(name, offset)] if src == rank else torch.empty(numel)
            collectives.broadcast(part, src=src, name=f"state_dict: {name}")
            whole[offset:offset + numel].copy_(part)
        yield name, whole.view(shape), spread_state.dtypes[name]
    for local_name, global_name, offset, shape in spread_state.local:
        if global_name in spread_state.colliding:  # no identity given: this rank's own, by local name
            value = spread_state.values[(global_name, offset)].view(shape).clone()
            yield local_name, value, spread_state.dtypes[global_name]


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
    spread_state = spread_pieces(engine, [u for u in engine.units if spread(u, world)])
    spread_state.check("export_full_weights")
    pieces, values, shapes = spread_state.pieces, spread_state.values, spread_state.shapes()
    # A tensor-parallel parameter is written whole (its global shape); DTensor assembles the TP shards.
    entries = [(s.name, out_dtype, tuple(s.param.shape)) for u in dense for s in u.slots if s.param.numel()]
    entries += [(name, out_dtype, shape) for name, shape in shapes.items() if math.prod(shape)]
    buffers = {name: b for name, b in model.named_buffers() if name in model.persistent_buffer_names() and b.numel()}
    entries += [(name, b.dtype, tuple(b.shape)) for name, b in buffers.items()]
    # A tied tensor (a head sharing the embedding's weight) is written under every name the model's
    # state_dict has, as separate bytes (safetensors refuses shared storage); rank 0 keeps the
    # canonical tensor's written copy until the end of the stream to write it again.
    known = {name: (dt, shape) for name, dt, shape in entries}
    aliases = {a: c for a, c in tied_aliases(model).items() if c in known and a not in known}
    entries += [(alias, *known[canonical]) for alias, canonical in aliases.items()]
    kept: dict[str, torch.Tensor] = {}
    path = Path(path)
    handle = open(path, "wb") if rank == 0 else None  # noqa: SIM115 - closed below, after streaming
    try:
        if handle is not None:
            handle.write(_safetensors_header(entries))
        for unit in dense:
            flat = gather_unit_masters(engine, unit)
            for slot in unit.slots:
                if not slot.param.numel():
                    continue
                # collective over the TP mesh for a DTensor parameter: every rank assembles it
                value = full_value(slot.param, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
                if handle is not None:
                    _write(handle, _keep(kept, slot.name, aliases, value.to(out_dtype)))
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
                _write(handle, _keep(kept, name, aliases, whole.to(out_dtype)))
        if handle is not None:
            for name, tensor in buffers.items():
                _write(handle, _keep(kept, name, aliases, tensor.detach()))
            for canonical in aliases.values():
                _write(handle, kept[canonical])
    finally:
        if handle is not None:
            handle.close()
    return path if rank == 0 else None


def _keep(kept: dict[str, torch.Tensor], name: str, aliases: dict[str, str], tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, also remembered under ``name`` when a tied alias will repeat it."""
    if name in aliases.values():
        kept[name] = tensor.clone()
    return tensor


def _write(handle: Any, tensor: torch.Tensor) -> None:
    handle.write(tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes())
