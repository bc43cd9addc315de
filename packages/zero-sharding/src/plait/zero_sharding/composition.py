"""How a feature package composes with ZeRO: the :class:`ShardingExtension` protocol, and the
optional members the engine calls on its extension objects (reducers, gatherers, placements).

Every integration (Lightning, the HF Trainer) composes the same way, with :func:`check_extensions`
before any process starts and :func:`apply_extensions` right before ``zero_shard``:

1. extensions run in their fixed ``order`` (10 sequence parallel, 20 MoE expert placement,
   30 activation checkpointing / offload of activations); ZeRO comes last;
2. each may transform the module (``apply(module, mesh)``, given the whole ``DeviceMesh`` or the
   process group the integration shards over);
3. each may supply ``zero_shard`` keyword arguments: an engine-wide ``reducer``, ``gatherer`` or
   ``placement`` (at most one extension each), or ``param_groups`` whose dicts carry per-group
   choices (``zero_group``, ``zero_distinct``, ``zero_grad_divisor``, ``zero_reducer``,
   ``zero_gatherer``, ``zero_placement``; see :func:`plait.zero_sharding.zero_shard`).

An optimizer class may bring its own exchange: ``zero_shard`` calls its ``compose_with_zero``
(plait-onebit-optim's 1-bit optimizers), which returns the inner optimizer class and an
engine-wide reducer; a reducer that also has ``all_gather`` (:class:`ParamGatherer`) is the
engine's gatherer too, unless ``zero_shard`` was given one.

Optional members of an extension *object* (a reducer, gatherer or placement), each called once
per object however many groups use it:

* ``bind(engine)``: right after the engine is built (units, groups and keys are final);
* ``on_step(step)`` / ``on_skipped_step(step)``: after each optimizer step that updated the
  masters, or that every rank skipped (fp16 overflow), with the number of steps taken so far;
* ``clip_requested(max_norm)``: ``ZeroOptimizer.clip_grad_norm_(max_norm)`` was called (after
  backward, before the step), for an extension that reduces something other than the gradients
  the engine clips (a 1-bit optimizer's momentum); it may raise to refuse;
* ``sharded_state_dict() -> dict[str, ShardedTensor]`` and ``load_sharded_state_dict(state)``:
  tensors of the extension (error-feedback buffers) saved and resharded with the model's
  :meth:`~plait.zero_sharding.ZeroModule.sharded_state_dict`; names must start with ``ext.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from torch import nn

ENGINE_WIDE = ("reducer", "gatherer", "placement")
ZERO_KWARGS = (*ENGINE_WIDE, "param_groups")


@runtime_checkable
class ShardingExtension(Protocol):
    """A feature composed with ZeRO by configuration (see the module docstring).

    Attributes:
        order: place in the fixed composition order; lower runs first.
    """

    order: int

    def check(self, settings: Any, precision: str) -> None:
        """Refuse an illegal combination with a ``ValueError`` before any process starts.

        Args:
            settings: the integration's configuration (e.g. ``plait.lightning.PlaitConfig``).
            precision: the host's precision flag (e.g. ``"bf16-mixed"``).
        """

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Transform the module (in place, or return a new one) before ZeRO shards it.

        Args:
            module: the model.
            mesh: the ``DeviceMesh`` (named dimensions) or process group ZeRO shards over.
        """

    def zero_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``zero_shard``: any of :data:`ZERO_KWARGS`."""


def check_extensions(extensions: Iterable[Any], settings: Any, precision: str,
                     claimed: dict[str, Any] | None = None) -> list[Any]:
    """Run every extension's ``check`` and refuse two extensions supplying one engine-wide piece.

    Args:
        extensions: the extensions.
        settings: passed to each ``check``.
        precision: passed to each ``check``.
        claimed: engine-wide pieces already taken (name -> who), e.g. ``{"placement": "offload"}``.

    Returns:
        The extensions in composition order.

    Raises:
        ValueError: an extension refuses, supplies an unknown keyword, or two supply one piece.
    """
    ordered = sorted(extensions, key=lambda e: e.order)
    taken = dict(claimed or {})
    for ext in ordered:
        ext.check(settings, precision)
        for key in ext.zero_kwargs():
            if key not in ZERO_KWARGS:
                raise ValueError(f"extension {ext!r} supplies zero_shard({key}=...); only {ZERO_KWARGS} can be set.")
            if key in ENGINE_WIDE and key in taken:
                raise ValueError(f"extensions {taken[key]!r} and {ext!r} both supply the ZeRO {key}; only one can be "
                                 "used engine-wide (give per-group ones through param_groups' zero_reducer / "
                                 "zero_gatherer instead).")
            taken[key] = ext
    return ordered


def apply_extensions(module: nn.Module, extensions: Iterable[Any], mesh: Any) -> tuple[nn.Module, dict[str, Any]]:
    """Apply the extensions in order and collect their ``zero_shard`` keyword arguments
    (``param_groups`` of several extensions are concatenated).

    Returns:
        ``(module, kwargs)`` to pass on to ``zero_shard``.
    """
    kwargs: dict[str, Any] = {}
    for ext in sorted(extensions, key=lambda e: e.order):
        module = ext.apply(module, mesh) or module
        for key, value in ext.zero_kwargs().items():
            if key == "param_groups":
                kwargs.setdefault("param_groups", []).extend(value)
            else:
                kwargs[key] = value
    return module, kwargs


def extension_objects(engine: Any) -> list[Any]:
    """Every distinct reducer, gatherer and placement of ``engine`` (engine-wide and per group),
    in a stable order."""
    found: dict[int, Any] = {}
    for obj in (engine.reducer, engine.gatherer, engine.placement, *getattr(engine.placement, "placements", ()),
                *(x for unit in engine.units for x in (unit.reducer, unit.gatherer))):
        if obj is not None:
            found.setdefault(id(obj), obj)
    return list(found.values())


def notify(engine: Any, event: str, *args: Any) -> None:
    """Call the optional member ``event`` of every extension object that has it."""
    for obj in extension_objects(engine):
        handler = getattr(obj, event, None)
        if handler is not None:
            handler(*args)
