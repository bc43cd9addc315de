"""Checkpoint state of a ZeRO-sharded pipeline stage, named as the whole model names it.

A pipeline stage's module (the ``submod`` of a ``torch.distributed.pipelining`` stage) is a
ZeroModule over its ``dp`` group, and its :meth:`~plait.zero_sharding.ZeroModule.sharded_state_dict`
names each tensor by the stage's own parameter names. A manually split stage renumbers its layers
from 0 (``layers.0`` on stage 1 is ``layers.4`` of the model), so two stages would describe
different tensors under one name. :func:`pipeline_stage_state` renames them: each stage's ZeRO
pieces (masters, optimizer state, step counters; tensor-parallel boxes included) carry the whole
model's names, so a checkpoint written by every stage is the whole model's, and it loads at any
other ``(dp, tp, pp)`` split, into one process, or into a plain model through an HF export.

A stage whose parameter names already are the whole model's needs no ``name_map`` (the default
keeps names unchanged).

Usage (with ``plait.universal_ckpt``)::

    state = pipeline_stage_state(stage_module, name_map=uc.layer_offset("layers.", first_layer), stage=pp_rank)
    uc.save({"model": state}, root, step=step)   # every rank of every stage
    uc.load({"model": state}, root)              # any stage split, including none
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from plait.kernels.sharded_state import ShardedTensor
from plait.zero_sharding.module import ZeroModule

# Prefixes of the names ZeroModule.sharded_state_dict() gives a parameter's pieces; the optimizer's
# are ``optim.<field>.<parameter>``. What follows the prefix is the stage-local parameter name.
_PARAMETER_PREFIX = "model."
_OPTIMIZER_PREFIX = "optim."
# Pieces that are not a parameter's (the loss scaler) keep their names: every stage has one of the
# same value and one process has one.
_UNNAMED = ("zero.",)


class ZeroStageState:
    """A ZeRO-sharded stage module as sharded state under the whole model's names.

    Built by :func:`pipeline_stage_state`; implements
    :class:`~plait.kernels.sharded_state.ShardedStateful` (``sharded_state_dict``,
    ``load_sharded_state_dict``) plus the optional ``checkpoint_aliases`` that checkpoint writers
    read (tied names).
    """

    def __init__(self, module: ZeroModule, name_map: Callable[[str], str], stage: int | None) -> None:
        self.module = module
        self.name_map = name_map
        self.stage = stage

    def global_name(self, name: str) -> str:
        """The whole model's name of a piece key of the stage's sharded state dict.

        Raises:
            ValueError: ``name_map`` returned something other than a non-empty string.
        """
        base, sep, index = name.partition("#")  # several pieces of one tensor: name#i
        if base.startswith(_UNNAMED):
            return name
        if base.startswith(_PARAMETER_PREFIX):
            head, local = _PARAMETER_PREFIX, base[len(_PARAMETER_PREFIX):]
        elif base.startswith(_OPTIMIZER_PREFIX):
            field, _, local = base[len(_OPTIMIZER_PREFIX):].partition(".")
            head = f"{_OPTIMIZER_PREFIX}{field}."
        else:
            raise ValueError(f"pipeline_stage_state: the stage's state holds {name!r}, which names no parameter; "
                             "extensions' pieces (ext.*) are not supported in a pipeline stage's checkpoint.")
        mapped = self.name_map(local)
        if not isinstance(mapped, str) or not mapped:
            raise ValueError(f"pipeline_stage_state: name_map({local!r}) returned {mapped!r}; it must return the "
                             "parameter's name in the whole model (a non-empty str).")
        return f"{head}{mapped}{sep}{index}"

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """The stage module's pieces (see :func:`plait.zero_sharding.checkpoint.sharded_state_dict`)
        renamed to the whole model's names; they alias the stage's live state.

        Raises:
            ValueError: two of the stage's names map to one name.
        """
        out: dict[str, ShardedTensor] = {}
        for name, piece in self.module.sharded_state_dict().items():
            new = self.global_name(name)
            if new in out:
                raise ValueError(f"pipeline_stage_state: name_map maps two of the stage's tensors to {new!r}; "
                                 "give each parameter its own name in the whole model.")
            spec = dataclasses.replace(piece.spec, name=self.global_name(piece.spec.name),
                                       pattern=self._with_stage(piece.spec.pattern, new))
            out[new] = ShardedTensor(spec, piece.local)
        return out

    def _with_stage(self, pattern: dict | None, name: str) -> dict | None:
        """``pattern`` plus this stage (``stages``: where the tensor lived, as universal checkpoints
        record it), for a parameter's pieces; the loss scaler is every stage's."""
        if self.stage is None or name.startswith(_UNNAMED):
            return pattern
        return {**(pattern or {}), "stages": [self.stage]}

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """Accept the pieces filled in place (the stage module refreshes its shards and
        parameters from its masters, as after any load)."""
        self.module.load_sharded_state_dict(state)

    def checkpoint_aliases(self) -> dict[str, str]:
        """Tied names of the stage, renamed like its pieces (``{alias: canonical}``)."""
        return {self.global_name(alias): self.global_name(canonical)
                for alias, canonical in self.module.checkpoint_aliases().items()}


def pipeline_stage_state(module: Any, *, name_map: Callable[[str], str] | None = None,
                         stage: int | None = None) -> ZeroStageState:
    """A ZeRO-sharded pipeline stage's checkpoint state under the whole model's names.

    Args:
        module: the stage's module after ``zero_shard`` (a :class:`~plait.zero_sharding.ZeroModule`),
            possibly tensor-parallel.
        name_map: the stage's parameter name -> the whole model's (for a stage that numbers its
            layers from 0: ``plait.universal_ckpt.layer_offset("layers.", first_layer)``); None
            keeps the names.
        stage: this rank's pipeline stage, recorded with each parameter's pieces (a universal
            checkpoint's pattern ``stages``); informational, names alone place the tensors.

    Returns:
        A :class:`ZeroStageState` to put in a checkpoint's state dict, on every rank of every stage.

    Raises:
        ValueError: ``module`` is not ZeRO-sharded, ``name_map`` is not callable or ``stage`` is
            not an int >= 0.
    """
    if not isinstance(module, ZeroModule):
        raise ValueError(f"pipeline_stage_state: module is a {type(module).__name__}; pass the stage's module "
                         "after zero_shard(stage_module, ..., mesh=mesh['dp']).")
    if name_map is not None and not callable(name_map):
        raise ValueError("pipeline_stage_state: name_map must be a callable stage name -> whole model name, "
                         "or None to keep the stage's names.")
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool) or stage < 0):
        raise ValueError(f"pipeline_stage_state: stage={stage!r} must be this rank's pipeline stage (int >= 0).")
    return ZeroStageState(module, name_map or (lambda name: name), stage)
