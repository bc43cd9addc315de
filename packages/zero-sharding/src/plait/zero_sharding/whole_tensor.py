"""Whole-tensor optimizers (Muon, LAMB, Adafactor, a user's own) under ZeRO stages 1, 2 and 3.

ZeRO keeps each rank's fp32 masters as a flat slice of a unit's parameters, which is exact only
for optimizers that update every element on its own. An optimizer whose update needs the whole
tensor (Muon's Newton-Schulz orthogonalisation, LAMB's trust ratio, Adafactor's factored moments)
runs under :class:`WholeTensorPlacement` instead:

1. every tensor has one *owner* rank in its unit's group, chosen so that the optimizer's work is
   balanced (:func:`update_cost`: Newton-Schulz costs about ``m * n * min(m, n)`` per matrix, not
   its bytes); the owner keeps the whole fp32 tensor the inner optimizer steps, and its state;
2. gradients are reduce-scattered as for any optimizer; at the step each unit's averaged
   gradient shards and master shards are all-gathered (one collective of ``2 * shard`` fp32
   elements per rank), so the owner has its tensors' whole reduced gradient and current master;
3. the inner optimizer steps, one unit at a time (only that unit's owned tensors hold a
   gradient, so the transient memory is one unit's gathered buffer), and each updated tensor is
   broadcast from its owner to the ranks whose master shards hold a piece of it.

The flat master shards stay the source of truth (``gathered_parameters(writeback=True)``, state
dict loads and checkpoints write them), so the whole tensors are refreshed from them every step.
The updated weights equal one process running the same optimizer on the same averaged gradients.

An optimizer declares itself with a class attribute ``whole_tensor = True`` or through
:func:`register_whole_tensor`; it may define ``whole_tensor_cost(shape) -> float`` to weigh its
tensors. It must keep per-tensor state and skip tensors whose ``grad`` is ``None`` (as every
``torch.optim`` optimizer does), because it is stepped once per unit.

With a host offload placement (plait-offload-io's ``zero_placement(OffloadConfig(device="cpu"))``)
the owner computes the update where the state lives: the flat masters are host copies, the reduced
gradients are copied to the host as they are reduced, the whole tensors and their optimizer state
are host tensors, and only the collectives' buffers are on the compute device. The placement's
parameter offload (``param_device``, stage 3) keeps working, since it concerns the compute shards.
With ``OffloadConfig(device="nvme")`` the flat masters stay in host memory as with ``"cpu"``, and
the whole tensors and their optimizer state are not kept between steps: the state of each unit's
owned tensors is a group of the offload's NVMe store, streamed through the step unit by unit
(:mod:`plait.zero_sharding.whole_tensor_store`).

Communication per step and rank, on top of the gradient reduce-scatter: the all-gather receives
``(W - 1) * 2 * shard_numel * 4`` bytes per unit, and each tensor whose pieces lie on ranks other
than its owner is broadcast once (``numel * 4`` bytes) over the unit's group, the tensors of one
owner in one broadcast per unit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from plait.kernels import collectives
from plait.zero_sharding.whole_tensor_store import WholeStateStore, placeholder

# Whole-tensor optimizers known by class name (classes from torch, transformers and plait that
# cannot carry the attribute themselves).
WHOLE_TENSOR_OPTIMIZERS = {"Muon", "Adafactor"}


def register_whole_tensor(cls: type) -> type:
    """Declare ``cls`` a whole-tensor optimizer (usable as a class decorator).

    Args:
        cls: an optimizer class whose update of a tensor needs the whole tensor.

    Returns:
        ``cls`` itself.

    Raises:
        ValueError: ``cls`` is not a class.
    """
    if not isinstance(cls, type):
        raise ValueError(f"register_whole_tensor({cls!r}): pass the optimizer class, e.g. "
                         "register_whole_tensor(Shampoo).")
    WHOLE_TENSOR_OPTIMIZERS.add(cls.__name__)
    return cls


def is_whole_tensor(cls: Any) -> bool:
    """Whether ``cls`` declared itself (``whole_tensor = True``) or was registered as a
    whole-tensor optimizer."""
    declared = getattr(cls, "whole_tensor", None)
    if declared is not None:
        return bool(declared)
    return getattr(cls, "__name__", None) in WHOLE_TENSOR_OPTIMIZERS


def update_cost(shape: tuple[int, ...]) -> float:
    """The work of one tensor's update: ``m * n * min(m, n)`` for a matrix (Newton-Schulz
    iterations; dimensions after the first are flattened into ``n``), ``numel`` otherwise."""
    numel = math.prod(shape)
    if len(shape) < 2:
        return float(numel)
    rows, cols = shape[0], numel // max(1, shape[0])
    return float(rows * cols * min(rows, cols))


def assign_owners(costs: list[float], ranks: int) -> list[int]:
    """Owner index in ``range(ranks)`` for each cost, greedily balancing the total cost per
    rank (largest first, ties to the lowest rank; the same answer on every rank)."""
    loads = [0.0] * ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


class WholeTensorPlacement:
    """A :class:`~plait.zero_sharding.extension.StatePlacement` for whole-tensor optimizers (see
    the module docstring). ``zero_shard`` builds it for an optimizer that declared itself.

    Args:
        units: the engine's flat units.
        cost: the update cost of a shape (default :func:`update_cost`).
        offload: a host offload placement (see :func:`check_placement`) whose device keeps the
            masters, the whole tensors and their state, and whose ``shard_storage()`` (if any)
            keeps stage-3 parameter shards; ``None``: everything stays on the compute device.
    """

    whole_tensor = True

    def __init__(self, units: list[Any], cost: Callable[[tuple[int, ...]], float] = update_cost, *,
                 offload: Any = None) -> None:
        self.offload = offload
        # Where the optimizer computes: the offload's host memory, else where ZeRO built the master.
        self.grad_device = None if offload is None else torch.device(offload.grad_device)
        self.offloads_parameters = bool(getattr(offload, "offloads_parameters", False))
        # NVMe: the owned state streams through the offload's store (built with the optimizer).
        self.state_store: WholeStateStore | None = None
        self._brought: list[str] = []  # unit keys materialize() brought in for a state_dict
        self.units = {unit.key: unit for unit in units}
        self._masters: dict[str, Tensor] = {}
        self.owner: dict[tuple[str, str], int] = {}  # (unit key, slot name) -> owner index in the group
        self.whole: dict[tuple[str, str], nn.Parameter] = {}  # the tensors this rank owns
        # piece name -> (state dict, key, 0-d tensor) for number-valued state (whole_state_pieces)
        self.scalars: dict[str, tuple[dict[str, Any], str, Tensor]] = {}
        by_group: dict[int, list[tuple[Any, Any]]] = {}
        for unit in units:
            by_group.setdefault(id(unit.group), []).extend((unit, slot) for slot in unit.slots)
        for pairs in by_group.values():
            owners = assign_owners([cost(tuple(slot.shape)) for _, slot in pairs], pairs[0][0].group_size)
            for (unit, slot), owner in zip(pairs, owners):
                self.owner[(unit.key, slot.name)] = owner

    def place_master(self, key: str, master: Tensor) -> Tensor:
        """Keep the flat master shard (the source of truth) where it is, or with an offload a host
        copy of it (page-locked when the master is on an accelerator), as ZeRO-Offload does."""
        if self.grad_device is not None and master.device != self.grad_device:
            host = torch.empty(master.shape, dtype=torch.float32, device=self.grad_device, pin_memory=master.is_cuda)
            master = nn.Parameter(host.copy_(master.detach()), requires_grad=True)
        elif self.grad_device is not None:
            master = nn.Parameter(master.detach().clone(), requires_grad=True)  # ZeRO's own stays the shard
        self._masters[key] = master
        return master

    def shard_storage(self) -> Any:
        """The offload's storage of stage-3 parameter shards (``param_device``), or ``None``."""
        offer = getattr(self.offload, "shard_storage", None)
        return offer() if callable(offer) else None

    def make_optimizer(self, build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                       param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """Build the user's optimizer over the whole fp32 tensors this rank owns, keeping the
        user's groups (a group may be empty on a rank that owns none of its tensors)."""
        key_of = {id(master): key for key, master in self._masters.items()}
        on_disk = self.offload is not None and self.offload.config.device == "nvme"
        groups = []
        for group in param_groups:
            owned = []
            for master in group["params"]:
                unit = self.units[key_of[id(master)]]
                for slot in unit.slots:
                    if self.owner[(unit.key, slot.name)] == unit.group_rank and slot.param.requires_grad:
                        # On NVMe a placeholder: a step fills it from the gathered master.
                        values = placeholder(slot.shape) if on_disk else \
                            torch.zeros(slot.shape, dtype=torch.float32, device=master.device)
                        whole = nn.Parameter(values)
                        self.whole[(unit.key, slot.name)] = whole
                        owned.append(whole)
            groups.append({**group, "params": owned})
        inner = build(groups)
        if on_disk:
            self.state_store = WholeStateStore(self.offload.whole_tensor_store())
            # An instance attribute, not torch's state_dict hooks: optimizers made of others
            # (MuonWithAdamW) define their own state_dict, which runs no hooks of the outer one.
            inner.state_dict = functools.partial(self._state_dict, inner, inner.state_dict)
        return inner

    def _state_dict(self, optimizer: torch.optim.Optimizer, original: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``optimizer.state_dict()`` with NVMe state: brought in for it, then dropped again
        (unchanged, the store keeps it) so that memory stays bounded."""
        self.materialize(optimizer)
        try:
            # torch's state_dict shares the per-tensor dicts with optimizer.state: copy them first.
            return _copy_containers(original())
        finally:
            owned = self.owned()
            for key in self._brought:
                self.state_store.drop(optimizer, owned[key])
            self._brought = []

    def owned(self) -> dict[str, list[nn.Parameter]]:
        """Unit key -> the whole tensors this rank owns in it (unit and slot order)."""
        out: dict[str, list[nn.Parameter]] = {}
        for (key, _name), whole in self.whole.items():
            out.setdefault(key, []).append(whole)
        return out

    def materialize(self, optimizer: torch.optim.Optimizer) -> None:
        """With NVMe state: bring all of it into ``optimizer.state`` for a reader (the next step
        stores it again, with any in-place edits). A no-op otherwise."""
        if self.state_store is not None:
            self._brought = self.state_store.materialize(optimizer, self.owned())

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, grads: Mapping[str, Tensor]) -> None:
        """Gather each unit's gradient and master shards, step the owned tensors, send them back."""
        keys = [key for key in self.units if key in grads]  # the same collectives in the same order on every rank
        owned = self.owned()
        for index, key in enumerate(keys):
            unit, grad = self.units[key], grads[key]
            if not isinstance(grad, Tensor):
                raise ValueError("a whole-tensor optimizer needs gradient shards in memory; turn gradient offload "
                                 "(grad_device='nvme') off.")
            grads_of, masters_of = self._gather(unit, grad)
            store, views = self.state_store, None
            if store is not None and key in owned:
                views = store.install(optimizer, key, owned[key])
                if index + 1 < len(keys) and keys[index + 1] in owned:
                    store.prefetch(optimizer, keys[index + 1], owned[keys[index + 1]])  # read while this steps
            for slot in unit.slots:
                whole = self.whole.get((key, slot.name))
                if whole is not None:
                    if store is not None:  # the placeholder views the gathered master meanwhile
                        whole.data = _flat_range(masters_of, slot.flat_range, unit.shard_numel).view(slot.shape)
                    else:
                        _copy_flat_range(whole.view(-1), masters_of, slot.flat_range, unit.shard_numel)
                    whole.grad = _flat_range(grads_of, slot.flat_range, unit.shard_numel).view(slot.shape)
            optimizer.step()
            for slot in unit.slots:  # the next unit's step must not move these again
                whole = self.whole.get((key, slot.name))
                if whole is not None:
                    whole.grad = None
            self._scatter_back(unit)
            if store is not None and key in owned:
                store.release(optimizer, key, owned[key], views)
                for whole in owned[key]:
                    whole.data = placeholder(whole.shape)
        if self.state_store is not None:
            self.state_store.flush()

    def _gather(self, unit: Any, grad: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Every group rank's flat shard of the unit's averaged gradient and of its fp32 master
        (two lists indexed by group rank), as views of the gathered buffer: the owner copies out
        only the pieces of the tensors it owns, not the whole unit twice."""
        master = self._masters[unit.key].detach()
        if unit.group_size == 1:
            return [grad.to(master.device).reshape(-1)], [master.reshape(-1)]
        # The collective runs on the compute device (NCCL needs it); the owner steps on the master's.
        mine = torch.cat([grad.to(unit.device, torch.float32).reshape(-1), master.to(unit.device).reshape(-1)])
        out = torch.empty(unit.group_size * mine.numel(), dtype=torch.float32, device=unit.device)
        collectives.all_gather_into_tensor(out, mine, group=unit.group,
                                           name=f"whole-tensor gather of unit `{unit.key}`")
        out = out.view(unit.group_size, 2, unit.shard_numel).to(master.device)
        return list(out[:, 0].unbind(0)), list(out[:, 1].unbind(0))

    def _scatter_back(self, unit: Any) -> None:
        """The updated tensors to the ranks holding their pieces; every rank writes its pieces.

        The tensors one owner sends are concatenated into one broadcast (at most one collective
        per owner and unit instead of one per tensor: over gloo each collective costs a round
        trip, and a transformer block has a dozen tensors); the bytes are the same."""
        master = self._masters[unit.key].detach()
        ranks = dist.get_process_group_ranks(unit.group) if unit.group_size > 1 else [0]
        sent: dict[int, list[Any]] = {}  # owner index -> its tensors other ranks hold pieces of
        for slot in unit.slots:
            if not slot.param.requires_grad:
                continue
            owner = self.owner[(unit.key, slot.name)]
            start, stop = slot.flat_range
            holders = range(start // unit.shard_numel, (stop - 1) // unit.shard_numel + 1)
            if any(h != owner for h in holders):
                sent.setdefault(owner, []).append(slot)
            elif (unit.key, slot.name) in self.whole:  # the owner alone holds this tensor's elements
                _write_piece(master, unit, slot, self.whole[(unit.key, slot.name)].detach().reshape(-1))
        for owner in sorted(sent):  # the same collectives in the same order on every rank
            slots = sent[owner]
            if owner == unit.group_rank:
                wholes = [self.whole[(unit.key, slot.name)].detach().reshape(-1) for slot in slots]
                buffer = (wholes[0] if len(wholes) == 1 else torch.cat(wholes)).to(unit.device)
            else:
                buffer = torch.empty(sum(slot.numel for slot in slots), dtype=torch.float32, device=unit.device)
            collectives.broadcast(buffer, src=ranks[owner], group=unit.group,
                                  name=f"whole-tensor updates of unit `{unit.key}` from its rank {owner}")
            offset = 0
            for slot in slots:
                _write_piece(master, unit, slot, buffer[offset:offset + slot.numel])
                offset += slot.numel

    def read_master(self, key: str, out: Tensor) -> None:
        """Copy (casting) the flat master shard into ``out``; a no-op when ``out`` is the master."""
        master = self._masters[key]
        if out.data_ptr() != master.data_ptr():
            out.copy_(master)

    def masters(self) -> Mapping[str, Tensor]:
        """key -> flat master shard."""
        return self._masters


def _pieces(shards: list[Tensor], flat_range: tuple[int, int], shard_numel: int) -> list[tuple[int, Tensor]]:
    """The pieces of the unit's flat range ``[start, stop)`` in the per-rank ``shards``: (offset
    of the piece in the range, a view of it)."""
    start, stop = flat_range
    out = []
    for rank in range(start // shard_numel, (stop - 1) // shard_numel + 1):
        lo, hi = max(start, rank * shard_numel), min(stop, (rank + 1) * shard_numel)
        out.append((lo - start, shards[rank][lo - rank * shard_numel:hi - rank * shard_numel]))
    return out


def _flat_range(shards: list[Tensor], flat_range: tuple[int, int], shard_numel: int) -> Tensor:
    """The unit's flat range ``[start, stop)`` from the per-rank ``shards``: a view when one rank
    holds all of it (no copy), else the pieces concatenated."""
    pieces = [piece for _, piece in _pieces(shards, flat_range, shard_numel)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _copy_flat_range(out: Tensor, shards: list[Tensor], flat_range: tuple[int, int], shard_numel: int) -> None:
    """Copy the unit's flat range ``[start, stop)`` from the per-rank ``shards`` into the flat ``out``."""
    for offset, piece in _pieces(shards, flat_range, shard_numel):
        out[offset:offset + piece.numel()].copy_(piece)


def _write_piece(master: Tensor, unit: Any, slot: Any, values: Tensor) -> None:
    """Write the elements of ``slot`` (``values``, the whole tensor flat) that fall in this rank's
    flat master shard of ``unit``."""
    lo, hi = unit.shard_range
    start, stop = slot.flat_range
    a, b = max(start, lo), min(stop, hi)
    if a < b:
        master[a - lo:b - lo].copy_(values[a - start:b - start])


def _copy_containers(value: Any) -> Any:
    """``value`` with every dict and list copied (the tensors and numbers in them shared)."""
    if isinstance(value, dict):
        return {key: _copy_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_containers(item) for item in value]
    return value


def whole_state_pieces(placement: WholeTensorPlacement, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state of the tensors this rank owns, as pieces of the sharded (universal)
    checkpoint, each held by its owner alone (at another world size the new owner reads it whole,
    wherever it was written), under ``optim.<state>.<global name>``:

    * a state shaped like its tensor (momentum, Adam's moments): as the tensor's flat range;
    * any other state tensor (step counters, Adafactor's factored row and column moments): whole,
      in its own shape;
    * a Python number (Adafactor's ``step``): as a 0-d int64/float64 tensor that
      :func:`restore_whole_scalars` writes back into the state after a load.

    Args:
        placement: the engine's placement (keeps the number holders until the load).
        optimizer: the inner (user's) optimizer over the owned whole tensors.

    Returns:
        name -> :class:`~plait.kernels.sharded_state.ShardedTensor`.

    Raises:
        ValueError: a state of another shape than its tensor, for a tensor that is a piece of a
            larger global tensor (tensor or expert parallelism): its global name would not say
            which piece it belongs to, so the save is refused rather than losing it.
    """
    from plait.kernels.sharded_state import ShardedTensor, ShardSpec

    rank, out = dist.get_rank() if dist.is_initialized() else 0, {}
    placement.materialize(optimizer)  # NVMe: the state into memory (a load then edits it in place)
    placement.scalars = {}
    for (key, name), whole in placement.whole.items():
        slot = next(s for s in placement.units[key].slots if s.name == name)
        base = slot.global_offset
        state = optimizer.state.get(whole, {})
        for state_name, value in state.items():
            if isinstance(value, bool) or not isinstance(value, Tensor | int | float):
                continue
            piece = f"optim.{state_name}.{slot.global_name}"
            if not isinstance(value, Tensor):
                value = torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)
                placement.scalars[piece] = (state, state_name, value)
            if value.shape == whole.shape:
                spec = ShardSpec(name=piece, kind="optimizer_state", dtype=value.dtype, global_shape=slot.global_shape,
                                 flat_range=(base, base + slot.numel), replica_ranks=(rank,))
                out[piece] = ShardedTensor(spec, value.view(-1))
            elif value.numel() == 1 or slot.is_global:
                out[piece] = ShardedTensor(ShardSpec.full(piece, value, kind="optimizer_state", replica_ranks=(rank,)),
                                           value.view(-1))
            else:
                shapes = f"shape {tuple(value.shape)} for {slot.name!r} (shape {tuple(whole.shape)})"
                raise ValueError(f"sharded_state_dict: {type(optimizer).__name__} keeps state {state_name!r} of "
                                 f"{shapes}, a piece of global tensor {slot.global_name!r}, which the sharded "
                                 "checkpoint layout cannot name. Save model.state_dict() and optimizer.state_dict() "
                                 "on every rank instead (resumable at the same world size).")
    return out


def restore_whole_scalars(placement: WholeTensorPlacement) -> None:
    """After a sharded load filled the pieces of :func:`whole_state_pieces` in place: write the
    number holders back into the optimizer state as the Python numbers they were."""
    for state, state_name, holder in getattr(placement, "scalars", {}).values():
        state[state_name] = holder.item()


def host_offload(placement: Any) -> bool:
    """Whether ``placement`` is a host offload the whole-tensor placement can run on: it names
    where state lives (``grad_device``) and an offload config (``config.device``), as
    plait-offload-io's ``ZeroOffloadPlacement`` does."""
    return hasattr(placement, "grad_device") and hasattr(getattr(placement, "config", None), "device")


def check_placement(cls: Any, placement: Any, param_groups: list[dict[str, Any]] | None) -> None:
    """Refuse a placement for a whole-tensor optimizer, before any work.

    Args:
        cls: the optimizer class.
        placement: ``zero_shard``'s ``placement`` argument.
        param_groups: ``zero_shard``'s ``param_groups`` (``zero_placement`` keys are checked).

    Raises:
        ValueError: a placement other than a host offload (per-group placements, a placement that
            steps flat shards), gradients on NVMe (``grad_device``) or a partial offload
            (``offload_ratio``).
    """
    if not is_whole_tensor(cls):
        return
    groups = [g for g in (param_groups or []) if isinstance(g, dict)]
    if (placement is not None and not host_offload(placement)) or any(g.get("zero_placement") is not None
                                                                     for g in groups):
        raise ValueError(f"optimizer {cls.__name__} updates whole tensors, which runs under plait's whole-tensor "
                         "placement; a custom placement (a param group's zero_placement, a placement stepping flat "
                         "shards) does not compose with it. Drop zero_placement / placement=, or pass "
                         "placement=zero_placement(OffloadConfig(device='cpu')) from plait-offload-io for the "
                         "whole model.")
    if placement is None:
        return
    config = placement.config
    if config.device == "nvme" and not callable(getattr(placement, "whole_tensor_store", None)):
        raise ValueError(f"optimizer {cls.__name__} updates whole tensors; this offload placement offers no store "
                         "for whole-tensor state on NVMe (whole_tensor_store()). Upgrade plait-offload-io or use "
                         "OffloadConfig(device='cpu').")
    if getattr(config, "grad_device", "cpu") == "nvme":
        raise ValueError(f"optimizer {cls.__name__} updates whole tensors, gathering each unit's reduced gradient "
                         "from memory; OffloadConfig.grad_device='nvme' keeps them in files. Use grad_device='cpu'.")
    if getattr(config, "offload_ratio", 1.0) != 1.0:
        raise ValueError(f"optimizer {cls.__name__} updates whole tensors, each on its owner rank; "
                         f"OffloadConfig.offload_ratio={config.offload_ratio} splits flat shards between host and "
                         "device, which does not apply. Use offload_ratio=1.0.")
