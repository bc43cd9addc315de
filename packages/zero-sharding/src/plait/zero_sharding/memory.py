"""Model-state memory: the ZeRO paper's formula and what a rank actually holds.

The paper (Rajbhandari et al., 2020, section 5) counts per rank, for ``Psi`` parameters, ``N``
ranks and ``K`` bytes of optimizer state per parameter (K = 12 for mixed-precision Adam: fp32
master, momentum, variance):

* baseline: ``(2 + 2 + K) Psi``
* stage 1 (P_os): ``2 Psi + 2 Psi + K Psi / N``
* stage 2 (P_os+g): ``2 Psi + (2 + K) Psi / N``
* stage 3 (P_os+g+p): ``(2 + 2 + K) Psi / N``

:func:`zero_formula_bytes` generalises it to the dtypes in use: compute parameters of ``p``
bytes, gradients reduced (and held) in ``g`` bytes, an fp32 master of 4 bytes only with mixed
precision (in fp32 the parameter shard *is* the master), and ``k`` bytes of optimizer moments.
Stage 1 keeps its full gradient buffer in the compute dtype. Activations and transient
communication buffers are not model state and are not counted.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.zero_sharding.tensor_parallel import local_numel

OPTIMIZER_STATE_BYTES = {"Adam": 8, "AdamW": 8, "SGD": 4, "Lion": 4, "Adagrad": 4, "RMSprop": 4}


def zero_formula_bytes(num_params: int, *, stage: int, world_size: int, compute_dtype: torch.dtype,
                       grad_dtype: torch.dtype, optimizer_state_bytes: int) -> float:
    """Model-state bytes per rank predicted by the ZeRO formula (see the module docstring).

    Args:
        num_params: ``Psi``.
        stage: 1, 2 or 3.
        world_size: ``N``, ranks sharing the state.
        compute_dtype: dtype of the model's parameters.
        grad_dtype: dtype gradients are reduced and held in (stages 2/3).
        optimizer_state_bytes: ``k`` (8 for Adam/AdamW moments, 4 for SGD momentum).

    Returns:
        Bytes per rank.
    """
    p = torch.empty((), dtype=compute_dtype).element_size()
    g = torch.empty((), dtype=grad_dtype).element_size()
    master = 4 if compute_dtype != torch.float32 else 0
    per_rank = num_params / world_size
    if stage == 1:
        return 2 * p * num_params + (master + optimizer_state_bytes) * per_rank
    if stage == 2:
        return p * num_params + (g + master + optimizer_state_bytes) * per_rank
    return (p + g + master + optimizer_state_bytes) * per_rank


def model_state_bytes(model: Any) -> dict[str, int]:
    """What this rank holds right now for a sharded model, by kind.

    Call it after backward (gradients present) and after at least one step (optimizer state
    allocated) to compare with the formula.

    Returns:
        ``{"params", "grads", "master", "optimizer", "total"}`` in bytes. ``master`` includes the
        whole fp32 tensors a whole-tensor optimizer's owner rank steps (Muon, LAMB...), as far as
        they are in memory (with NVMe offload they are placeholders between steps).
    """
    engine, optimizer = model.zero_engine, model.zero_optimizer
    out = {"params": 0, "grads": 0, "master": 0, "optimizer": 0}
    for unit in engine.units:
        for kind, nbytes in unit.state_bytes().items():
            out[kind] += nbytes
        for slot in unit.slots:  # unreduced gradients still on the parameters (no_sync, stage 3 in flight)
            grad = slot.param.grad
            if grad is not None and unit.full_grad is None:
                out["grads"] += local_numel(grad) * grad.element_size()
    # Whole-tensor optimizers: the owner's whole fp32 copies of the tensors it steps (see whole_tensor.py).
    for whole in getattr(engine.placement, "whole", {}).values():
        out["master"] += whole.untyped_storage().nbytes()  # a placeholder (NVMe) holds one element
    for state in optimizer.inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out["optimizer"] += value.numel() * value.element_size()
    out["total"] = sum(out.values())
    return out
