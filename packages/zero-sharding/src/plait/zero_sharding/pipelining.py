"""ZeRO inside ``torch.distributed.pipelining``: each pipeline stage's module sharded over its ``dp`` group.

Composition, not a pipeline engine of plait's own: the stage module is sharded by
:func:`~plait.zero_sharding.zero_shard` over the ``dp`` dimension of the mesh, and torch's own
``PipelineStage`` and schedules (GPipe, 1F1B, ...) run it over the ``pp`` dimension. The
activations crossing stage boundaries are torch's; plait touches only the stage's parameters,
gradients and optimizer state.

Plain ``PipelineStage`` already trains a ZeRO-sharded stage correctly (every microbatch's backward
reduces its gradients, which then accumulate). :class:`ZeroPipelineStage` makes it cheaper, as
torch's stage does for DDP and FSDP2: the microbatches' backward passes accumulate locally and only
the last one of a step reduces, so a step's data-parallel traffic is that of one backward however
many microbatches the schedule runs. It also tells the ZeRO engine that its module is one stage of
``num_stages``, so global-norm clipping (``optimizer.clip_grad_norm_``, ``ZeroConfig.max_grad_norm``)
clips by the norm of the whole model across stages (and ``tp``, ``dp``): under plain
``PipelineStage`` the ranks of the other stages would count as copies of this stage's parameters.

Usage::

    mesh = init_device_mesh("cuda", (dp, pp), mesh_dim_names=("dp", "pp"))
    stage_module, optimizer = zero_shard(stage_module, torch.optim.AdamW, ZeroConfig(stage=3),
                                         mesh=mesh["dp"], lr=3e-4)
    stage = ZeroPipelineStage(stage_module, pp_rank, pp_size, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage

from plait.zero_sharding.module import ZeroModule


class ZeroPipelineStage(PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` whose ZeRO-sharded module reduces gradients once
    per step: at the schedule's last backward of the step, not at every microbatch.

    Takes ``PipelineStage``'s arguments; the stage module is a :class:`~plait.zero_sharding.ZeroModule`
    (from ``zero_shard`` over the ``dp`` group). Any other module runs as under ``PipelineStage``.
    """

    def __init__(self, submodule: Any, stage_index: int, num_stages: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, stage_index, num_stages, *args, **kwargs)
        if isinstance(submodule, ZeroModule):
            # The gradient norm's world all-reduce must not count the other stages' ranks as copies.
            submodule.zero_engine.pipeline_stages = num_stages

    def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict,
                                   last_backward: bool = False) -> Any:
        """One microbatch's backward; without gradient communication unless it is the step's last.

        Args:
            backward_type: torch's backward kind (``"full"``, ``"input"`` or ``"weight"``).
            bwd_kwargs: what torch's stage passes to its backward helpers.
            last_backward: the schedule's flag for the step's last backward of this stage.

        Returns:
            What ``PipelineStage.backward_maybe_with_nosync`` returns.
        """
        if not isinstance(self.submod, ZeroModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_requires_gradient_sync(last_backward)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            # Leave the module as an ordinary training loop expects it.
            self.submod.set_requires_gradient_sync(True)
