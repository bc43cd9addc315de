"""Extension points: how gradients are reduced, how parameters are gathered, where state lives.

The engine talks to communication and optimizer-state placement only through these three
protocols, so other packages change *how* without touching the engine:

* :class:`GradientReducer` - ZeRO++ quantized reduce-scatter, 1-bit optimizers.
* :class:`ParamGatherer` - ZeRO++ quantized / hierarchical all-gather.
* :class:`StatePlacement` - plait-offload-io keeps fp32 masters and optimizer state on CPU or NVMe
  and runs the optimizer step there.
* :class:`ShardStorage` - offered by a placement (``placement.shard_storage()``): where stage-3
  compute-dtype parameter shards live while no gather needs them (ZeRO-Infinity's parameter
  offload to CPU or NVMe).

The defaults (:class:`DefaultReducer`, :class:`DefaultGatherer`, :class:`LocalPlacement`) go
through :mod:`plait.kernels.collectives`, so the byte ledger sees every byte.

Handles: ``reduce_scatter``, ``all_reduce`` and ``all_gather`` may return ``None`` (the work is
done when the call returns) or an object with a ``wait()`` method (the work is in flight; the
engine calls ``wait()`` before it reads the output). The engine never assumes either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from plait.kernels import collectives

GATHER_PHASES = ("forward", "backward", "step")


@runtime_checkable
class GradientReducer(Protocol):
    """How gradients are reduced across the sharding group."""

    def reduce_scatter(self, full: Tensor, shard_out: Tensor, *, group: Any, key: str) -> Any:
        """Reduce a bucket and keep this rank's part.

        Args:
            full: flat 1-D bucket of ``world * shard`` elements in the reduce dtype (rank ``r``'s
                part is ``full[r * shard:(r + 1) * shard]``).
            shard_out: 1-D tensor of ``shard`` elements, same dtype; receives the SUM over the
                group of this rank's part (the engine divides for averaging).
            group: the process group to reduce over.
            key: a stable id of the bucket (the same on every rank and every step), for
                per-bucket state such as error feedback.

        Returns:
            ``None`` or a handle with ``wait()``.
        """

    def all_reduce(self, tensor: Tensor, *, group: Any, key: str) -> Any:
        """In-place SUM of ``tensor`` over ``group`` (used where a bucket is not sharded).

        Returns:
            ``None`` or a handle with ``wait()``.
        """


@runtime_checkable
class ParamGatherer(Protocol):
    """How parameter shards are gathered into full flat buffers."""

    def all_gather(self, shard: Tensor, full_out: Tensor, *, group: Any, key: str, phase: str) -> Any:
        """Gather every rank's ``shard`` into ``full_out``.

        Args:
            shard: this rank's 1-D shard (compute dtype).
            full_out: 1-D tensor of ``world * shard.numel()`` elements, same dtype.
            group: the process group.
            key: stable id of the parameter group (unit).
            phase: ``"forward"``, ``"backward"`` (stage 3 just-in-time gathers) or ``"step"``
                (refreshing replicated parameters after the optimizer step; a lossy gatherer
                should be exact here or the replicas drift from the masters).

        Returns:
            ``None`` or a handle with ``wait()``.
        """


@runtime_checkable
class StatePlacement(Protocol):
    """Where fp32 master shards and optimizer state live, and where the optimizer step runs.

    Life cycle: at sharding time the engine calls :meth:`place_master` once per unit key, then
    :meth:`make_optimizer` once. Each ``optimizer.step()`` calls :meth:`step` with the unscaled,
    clipped fp32 gradient shards (on the compute device), then :meth:`read_master` per key to
    refresh the compute-dtype parameter shards.

    Optional members:

    * ``grad_device``: where the engine keeps reduced gradient slices. A placement stepping on
      the CPU says ``"cpu"``: each slice is copied to page-locked host memory as soon as its
      reduce-scatter is done, overlapping the rest of backward, and the norm, unscaling and
      clipping run there.
    * ``offloads_parameters`` (bool): ``True`` makes ``zero_shard`` refuse stages 1/2 before any
      work.
    * ``shard_storage()``: a :class:`ShardStorage` or ``None``; called once after
      :meth:`make_optimizer`, the engine then keeps stage-3 shards in it.
    * ``grad_storage()``: a :class:`ShardStorage` whose ``read`` also takes ``offset=`` (bytes),
      or ``None``; called once after :meth:`make_optimizer` (stages 2/3). The engine then writes
      each unit's reduced gradient shard there as soon as it is folded and frees it, and
      :meth:`step` receives, for those keys, a
      :class:`~plait.zero_sharding.grad_stash.StashedGrad` (``read(start, end)`` gives fp32
      elements with the scaling applied) instead of a tensor.
    * ``backward_started()``: called when a backward begins (its first gradient hook), e.g. to
      start reading offloaded optimizer state so the read overlaps backward.
    * ``check_model(model, world_size)``: called by ``zero_shard`` before any unit is built, with
      the model and the size of the group it is sharded over; may raise ``ValueError`` (a memory
      budget the model cannot fit) or adjust the placement's own settings.
    """

    def place_master(self, key: str, master: Tensor) -> Tensor:
        """Take an fp32 master shard (an ``nn.Parameter`` on the compute device) and return the
        ``nn.Parameter`` the optimizer will update: the same one when kept in place, one living
        elsewhere (CPU, NVMe-backed) otherwise. ``optimizer.state`` is keyed by what is returned."""

    def make_optimizer(self, build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                       param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """Construct the inner optimizer. ``param_groups`` reference the placed masters;
        ``build(param_groups)`` constructs the user's optimizer class with the user's options."""

    def step(self, optimizer: torch.optim.Optimizer, grads: Mapping[str, Tensor]) -> None:
        """One optimizer step: ``grads`` maps key -> fp32 gradient shard (compute device).
        Attach each to its master's ``.grad``, run ``optimizer.step()``, release the grads.
        The gradients are read-only: one may be the unit's accumulated gradient itself.

        Optional third parameter ``ready: Callable[[str], None]``: a placement whose masters are
        cheap to read only at certain times (NVMe-resident masters, readable while their
        sub-group is in memory) declares it and calls ``ready(key)`` once the master of ``key``
        is final for this step; the engine then refreshes that key's compute shard right away
        (through :meth:`read_master`) and skips it afterwards."""

    def read_master(self, key: str, out: Tensor) -> None:
        """Copy the current master of ``key`` into ``out`` (compute device, any float dtype)."""

    def masters(self) -> Mapping[str, Tensor]:
        """key -> the placed master tensor (what ``optimizer.state`` is keyed by)."""


@runtime_checkable
class ShardStorage(Protocol):
    """Where a stage-3 unit's compute-dtype shard (the all-gather input) lives between uses.

    The engine attaches a storage to every sharded (non-resident) unit whose shard is not itself
    the optimizer's master. It writes the shard once, then frees the shard's memory (its data
    becomes a one-element placeholder, so the tensor keeps its identity); before each gather it
    reads the shard back (started early by the engine's prefetch), after the gather it frees it
    again, and after each optimizer step it writes the new values. Handles follow the module's
    convention.

    Optional members (not part of the protocol check): ``reserve(nbytes, shards)`` is called
    before the first write with the shards' total size, to refuse a disk without room before any
    work; ``empty(numel, *, dtype, device)`` allocates a shard's memory when it is loaded (e.g.
    aligned, so file I/O needs no bounce copy); the default is ``torch.empty``;
    ``discard(key)`` forgets a key (``sharded_init(placement=...)`` stores constructed slices
    under ``init-<n>`` keys and discards each once ``zero_shard`` took it over).
    """

    def write(self, key: str, shard: Tensor) -> Any:
        """Persist ``shard``'s values for ``key``; ``shard`` stays allocated and unmodified until
        the handle is waited. A failed write raises an ``OSError`` from ``wait`` (or here) and
        the engine keeps the shard in memory, so nothing is lost."""

    def read(self, key: str, out: Tensor) -> Any:
        """Fill ``out`` (the shard, re-allocated, same shape/dtype/device) with the last values
        written for ``key``."""

    def finish_step(self, errors: list[BaseException]) -> None:
        """Called on every rank after a step's shard writes settled, with this rank's write
        failures. Raise to fail the step; a storage should make every rank raise together (a
        failure flag all-reduced over the world) so none is left waiting in a collective."""


class DefaultReducer:
    """Plain reduce-scatter / all-reduce through :mod:`plait.kernels.collectives`, async."""

    def reduce_scatter(self, full: Tensor, shard_out: Tensor, *, group: Any, key: str) -> Any:
        """See :meth:`GradientReducer.reduce_scatter`."""
        return collectives.reduce_scatter_tensor(shard_out, full, group=group, async_op=True)

    def all_reduce(self, tensor: Tensor, *, group: Any, key: str) -> Any:
        """See :meth:`GradientReducer.all_reduce`."""
        return collectives.all_reduce(tensor, group=group, async_op=True)


class DefaultGatherer:
    """Plain all-gather through :mod:`plait.kernels.collectives`, async."""

    def all_gather(self, shard: Tensor, full_out: Tensor, *, group: Any, key: str, phase: str) -> Any:
        """See :meth:`ParamGatherer.all_gather`."""
        return collectives.all_gather_into_tensor(full_out, shard, group=group, async_op=True)


class LocalPlacement:
    """Masters and optimizer state stay where they were built; the step runs there."""

    def __init__(self) -> None:
        self._masters: dict[str, Tensor] = {}

    def place_master(self, key: str, master: Tensor) -> Tensor:
        """Keep the master where it is."""
        self._masters[key] = master
        return master

    def make_optimizer(self, build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                       param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """Build the user's optimizer over the masters."""
        return build(param_groups)

    def step(self, optimizer: torch.optim.Optimizer, grads: Mapping[str, Tensor]) -> None:
        """Attach grads, step, release."""
        for key, grad in grads.items():
            self._masters[key].grad = grad
        optimizer.step()
        for key in grads:
            self._masters[key].grad = None

    def read_master(self, key: str, out: Tensor) -> None:
        """Copy (casting) the master into ``out``; a no-op when ``out`` is the master itself."""
        master = self._masters[key]
        if out.data_ptr() != master.data_ptr():
            out.copy_(master)

    def masters(self) -> Mapping[str, Tensor]:
        """key -> master."""
        return self._masters


def wait(handle: Any) -> None:
    """Wait on a handle returned by an extension (``None`` means already done)."""
    if handle is not None:
        handle.wait()
