"""Checkpoints of a ``PlaitStrategy(pp_size=N)`` run: every stage's pieces under the whole model's names.

Each rank of a pipelined run holds one stage of the model (see :mod:`plait.lightning.pipeline_parallel`).
A stage built by a manual split usually numbers its layers from 0, so stage 1's ``stage.0.weight``
is the whole model's ``stage.2.weight``: written as they are, two stages' tensors would share a name
and one would overwrite or be mistaken for the other. The LightningModule says how its names map to
the whole model's by setting ``self.pipeline_name_map`` in ``configure_model`` (a callable, such as
``plait.universal_ckpt.layer_offset("stage.", first_layer)``; leave it unset when the stage already
uses the whole model's names). The strategy then saves through
:func:`plait.zero_sharding.stage_checkpoint.pipeline_stage_state`, so the checkpoint directory is
the whole model's universal checkpoint:

* it resumes at the same ``(dp, pp)`` bit for bit (``ckpt_path=``);
* it loads at another ``(dp', pp')``, into a LightningModule that builds the whole model under a
  strategy without ``pp_size``, and exports whole weights (``plait.lightning.consolidated_state_dict``
  / ``export_weights``) with the whole model's names.

Two stages whose mapped names collide are refused on every rank, before anything is written or read,
naming the parameter, the stages and the fix.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from plait.lightning.checkpoint import PIECE_PREFIX, ShardedModelView

NAME_MAP_ATTRIBUTE = "pipeline_name_map"
__all__ = ["NAME_MAP_ATTRIBUTE", "PipelineModelView", "check_distinct_names"]


class PipelineModelView(ShardedModelView):
    """A pipeline stage's LightningModule as the whole model's sharded state.

    Built on every rank before a save or load starts (collective: the stages' names are checked
    against each other here, so a collision is refused before anything is written or read).

    Args:
        module: the ZeRO-sharded LightningModule of this rank's stage, whose ``device_mesh`` has a
            ``pipeline_parallel`` dimension; its optional ``pipeline_name_map`` renames its
            parameters to the whole model's.

    Raises:
        ValueError: ``pipeline_name_map`` is set to something not callable, or two stages name a
            parameter alike (on every rank); both name the fix.
    """

    def __init__(self, module: Any) -> None:
        from plait.zero_sharding.stage_checkpoint import pipeline_stage_state

        name_map = getattr(module, NAME_MAP_ATTRIBUTE, None)
        if name_map is not None and not callable(name_map):
            raise ValueError(f"LightningModule.{NAME_MAP_ATTRIBUTE}={name_map!r} must be a callable (stage name -> "
                             "whole model name), e.g. plait.universal_ckpt.layer_offset('stage.', first_layer), or "
                             "None when the stage already uses the whole model's names.")
        pp = module.device_mesh["pipeline_parallel"]
        self.stage, self.stages = pp.get_local_rank(), pp.size()
        super().__init__(pipeline_stage_state(module, name_map=name_map, stage=self.stage))
        check_distinct_names(self.module.sharded_state_dict(), self.stage, self.stages)

    def checkpoint_aliases(self) -> dict[str, str]:
        """The stage's tied names, renamed like its pieces."""
        return self.module.checkpoint_aliases()


def _parameter_names(pieces: dict[str, Any]) -> list[str]:
    """The parameter names of a sharded state dict's pieces (``model.<name>`` or ``model.<name>#i``)."""
    return sorted({name[len(PIECE_PREFIX):].partition("#")[0] for name in pieces if name.startswith(PIECE_PREFIX)})


def check_distinct_names(pieces: dict[str, Any], stage: int, stages: int) -> None:
    """Refuse pieces whose parameter names another pipeline stage also uses (collective: one
    small all-gather of names over the world, so every rank raises alike).

    Args:
        pieces: this rank's sharded state dict, already under the whole model's names.
        stage: this rank's pipeline stage.
        stages: the number of stages.

    Raises:
        ValueError: naming the first shared parameter, the two stages and the fix.
    """
    mine = (stage, _parameter_names(pieces))
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    owner: dict[str, int] = {}
    for other, names in everyone:
        for name in names:
            first = owner.setdefault(name, other)
            if first != other:
                raise ValueError(
                    f"PlaitStrategy(pp_size={stages}): pipeline stages {first} and {other} both name a parameter "
                    f"{name!r}, so a checkpoint cannot tell their tensors apart. In configure_model, set "
                    f"self.{NAME_MAP_ATTRIBUTE} to map this stage's parameter names to the whole model's, e.g. "
                    "plait.universal_ckpt.layer_offset('<layers prefix>.', <the stage's first layer>).")


_AUTOMATIC = "epoch_loop.automatic_optimization.optim_progress"
_MANUAL = "epoch_loop.manual_optimization.optim_step_progress"


def carry_optimizer_steps(checkpoint: dict[str, Any], automatic: bool) -> dict[str, Any]:
    """Move the optimizer-step count of a checkpoint saved under the other optimization mode to
    the one ``automatic`` names, in place.

    Lightning's ``trainer.global_step`` is the optimizer steps of the loop that ran: a pipelined
    run counts them in its manual-optimization loop, a run without ``pp_size`` usually in its
    automatic one. Resumed across the two, the restored count would be 0, and the run would train
    ``global_step`` steps again (with its schedulers and ``max_steps``) from the loaded weights.
    The count is moved only when the target loop has none and the other has some.

    Args:
        checkpoint: Lightning's part of a loaded checkpoint (``loops`` inside).
        automatic: the LightningModule's ``automatic_optimization``.

    Returns:
        ``checkpoint``.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    auto, manual = fit.get(_AUTOMATIC), fit.get(_MANUAL)
    if not isinstance(auto, dict) or not isinstance(manual, dict):
        return checkpoint  # another Lightning version's layout: leave it to Lightning
    step = auto["optimizer"]["step"]
    if automatic and step["total"]["completed"] == 0 and manual["total"]["completed"] > 0:
        for part in ("total", "current"):
            step[part] = dict(manual[part])
            auto["optimizer"]["zero_grad"][part] = {**manual[part], "started": manual[part]["completed"]}
    elif not automatic and manual["total"]["completed"] == 0 and step["total"]["completed"] > 0:
        for part in ("total", "current"):
            manual[part] = dict(step[part])
    return checkpoint
