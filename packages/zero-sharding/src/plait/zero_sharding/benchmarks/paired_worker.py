"""What every rank runs in the paired benchmark (module level, so the gloo harness can import it).

For each ZeRO stage of a :class:`~.paired_setup.PairedJob`, the rank builds plait at that stage
and its peers in the same process, then either

* ``timed`` (world size 2): alternates their steps (A B C A B C ..., shared/benchmarks.md), so
  the machine's noise falls on every contender alike, then counts one more step of each; or
* untimed (any world size): trains each contender alone for the warm-up steps and counts one
  more step, freeing it before the next is built (lower peak memory at world size 4).

The counted step gives logical bytes (the byte ledger; peers through ``count_torch_distributed``,
entered before DeepSpeed binds its collective functions, and DDP's comm hook) and model-state
bytes after ``optimizer.step()``. A peer that cannot be built or run here is reported by its
error, never fatal.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable
from typing import Any

import torch

from plait.kernels.bench import interleaved_timing
from plait.kernels.collectives import ByteLedger, count_torch_distributed
from plait.zero_sharding.benchmarks.paired_setup import (
    Contender,
    PairedJob,
    batch_for,
    contenders_for,
    state_storage_bytes,
)

CONTROL_BYTES = 16  # plait's one float64[2] all-reduce per step: global grad norm + overflow flag


def _error_text(exc: BaseException) -> str:
    """The exception's first line and the innermost frame, short enough for a table note."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else ""
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}: {first}{where}"


def _build(builder: Callable[[], Contender]) -> tuple[Contender | None, str]:
    try:
        return builder(), ""
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
        return None, _error_text(exc)


def plait_expected_bytes(model: Any) -> dict[str, int]:
    """Exactly what plait's engine must move per step, from its units: every unit's padded flat
    buffer is reduce-scattered once and gathered once (stages 1/2: after the step) or twice
    (stage 3: forward and backward; the root unit stays gathered from forward to the end of
    backward, as FSDP2's root does, so it is gathered once), plus the control all-reduce.

    Returns:
        ``{"reduce_scatter", "all_gather", "volume", "psi", "padding", "root"}`` (bytes, and
        elements for the last three).
    """
    engine = model.zero_engine
    out = {"reduce_scatter": 0, "all_gather": 0, "padding": 0, "root": 0}
    for unit in engine.units:
        compute = torch.empty((), dtype=unit.compute_dtype).element_size()
        reduce = torch.empty((), dtype=unit.reduce_dtype).element_size()
        out["reduce_scatter"] += unit.padded_numel * reduce
        out["padding"] += unit.padded_numel - unit.numel
        once = unit.resident or unit in engine.partition.root_units
        out["all_gather"] += (1 if once else 2) * unit.padded_numel * compute
        if unit in engine.partition.root_units and not unit.resident:
            out["root"] += unit.padded_numel
    out["volume"] = out["reduce_scatter"] + out["all_gather"] + 2 * CONTROL_BYTES  # volume(): all-reduce x2
    out["psi"] = sum(p.numel() for p in model.parameters())
    return out


def _count_step(contender: Contender, job: PairedJob, step: int) -> dict[str, Any]:
    """One counted step: ledger bytes, then model-state bytes with gradients still held."""
    contender.zero_grad()
    with ByteLedger() as ledger:
        loss = contender.train(batch_for(job, step))
    figures: dict[str, Any] = {"volume": ledger.volume(), "by_op": ledger.by_op(), "loss": float(loss),
                               "memory": state_storage_bytes(*contender.state_roots)}
    if contender.name.startswith("plait"):
        from plait.zero_sharding import model_state_bytes

        figures["model_state"] = model_state_bytes(contender.model)
        figures["expected"] = plait_expected_bytes(contender.model)
        breakdown = contender.optimizer.last_breakdown
        figures["breakdown"] = breakdown.as_dict() if breakdown is not None else None
    return figures


def _timed_stage(job: PairedJob, stage: int) -> dict[str, Any]:
    built: dict[str, Contender] = {}
    errors: dict[str, str] = {}
    for name, builder in contenders_for(job, stage).items():
        contender, error = _build(builder)
        if contender is None:
            errors[name] = error
        else:
            built[name] = contender
    steps_done = dict.fromkeys(built, 0)
    first_loss: dict[str, float] = {}
    failed: dict[str, str] = {}

    def stepper(contender: Contender) -> Callable[[], None]:
        def step() -> None:
            if contender.name in failed:
                return
            try:
                contender.zero_grad()
                loss = contender.train(batch_for(job, steps_done[contender.name]))
                first_loss.setdefault(contender.name, float(loss))
            except Exception as exc:  # noqa: BLE001 - a peer failing mid-run is reported (fails alike on all ranks)
                failed[contender.name] = _error_text(exc)
            steps_done[contender.name] += 1

        return step

    timings = interleaved_timing({name: stepper(c) for name, c in built.items()}, warmup=job.warmup,
                                 steps=job.steps)
    figures = {name: _count_step(c, job, steps_done[name]) for name, c in built.items() if name not in failed}
    timings = {name: stats for name, stats in timings.items() if name not in failed}
    for name, value in first_loss.items():
        if name in figures:
            figures[name]["first_loss"] = value
    return {"timings": timings, "errors": {**errors, **failed}, "figures": figures}


def _static_stage(job: PairedJob, stage: int) -> dict[str, Any]:
    errors: dict[str, str] = {}
    figures: dict[str, Any] = {}
    for name, builder in contenders_for(job, stage).items():
        contender, error = _build(builder)
        if contender is None:
            errors[name] = error
            continue
        try:
            losses = []
            for step in range(job.warmup):
                contender.zero_grad()
                losses.append(float(contender.train(batch_for(job, step))))
            figures[name] = {**_count_step(contender, job, job.warmup), "first_loss": losses[0]}
        except Exception as exc:  # noqa: BLE001 - same rule as building: report the peer's failure
            errors[name] = _error_text(exc)
        del contender
        gc.collect()
    return {"timings": {}, "errors": errors, "figures": figures}


def run_paired(job: PairedJob) -> dict[int, dict[str, Any]]:
    """Every rank's entry point: measure each stage of ``job``.

    Args:
        job: what to measure.

    Returns:
        stage -> ``{"timings": name -> TimingStats, "errors": name -> text, "figures": name ->
        {"volume", "by_op", "loss", "memory", ...}}`` for this rank.
    """
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results: dict[int, dict[str, Any]] = {}
    # Entered before any peer is built: DeepSpeed binds torch.distributed's functions when its
    # backend starts, so only functions already wrapped for counting are seen later.
    with count_torch_distributed():
        for stage in job.stages:
            results[stage] = _timed_stage(job, stage) if job.timed else _static_stage(job, stage)
            gc.collect()
    return results
