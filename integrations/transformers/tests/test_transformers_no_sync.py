"""Gradient accumulation through the Trainer sends no gradient bytes until the last micro-batch.

The byte ledger is open for the whole run; a callback reads it at each optimizer step's start,
after each non-final micro-batch (``on_substep_end``) and at the step's end. Between the step's
start and the first micro-batch's end no gradient collective (reduce-scatter, all-reduce) may
run; the last micro-batch reduces exactly the formula's bytes: every trainable element once, in
the reduce dtype (fp32 here), ``Psi x 4`` logical bytes per step whatever the stage, plus the
one 16-byte all-reduce of the global gradient norm (two float64: the sum of squares and the
non-finite flag) that ``max_grad_norm`` clipping needs.
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.kernels.testing import run_distributed

GA, STEPS = 2, 3
GRADIENT_OPS = ("reduce_scatter", "all_reduce")
NORM_BYTES = 2 * 8


def _counting_callback() -> Any:
    from transformers import TrainerCallback

    from plait.kernels.collectives import ByteLedger

    class Counting(TrainerCallback):
        """Ledger snapshots (gradient-op bytes) at each step boundary and micro-batch end."""

        def __init__(self) -> None:
            self.ledger = ByteLedger()
            self.marks: list[tuple[str, int]] = []

        def _mark(self, what: str) -> None:
            self.marks.append((what, sum(self.ledger.total(op=op) for op in GRADIENT_OPS)))

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.ledger.__enter__()

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self._mark("step_begin")

        def on_substep_end(self, *args: Any, **kwargs: Any) -> None:
            self._mark("substep_end")

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self._mark("step_end")

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            self.ledger.__exit__(None, None, None)

    return Counting()


def _rank(tmp: str) -> dict[str, Any]:
    from plait.transformers.demo import tiny_llama_model, train

    psi = sum(p.numel() for p in tiny_llama_model().parameters())
    out: dict[str, Any] = {"psi": psi}
    for stage in (1, 2, 3):
        counting = _counting_callback()
        train("plait", f"{tmp}/zero{stage}", plait={"zero": {"stage": stage}}, max_steps=STEPS,
              gradient_accumulation_steps=GA, callbacks=(counting,))
        out[stage] = counting.marks
    return out


@pytest.mark.timeout(300)
def test_accumulation_micro_batches_send_no_gradient_bytes(tmp_path):
    result = run_distributed(_rank, 2, str(tmp_path), timeout=270)[0]
    psi = result["psi"]
    for stage in (1, 2, 3):
        marks = result[stage]
        kinds = [what for what, _ in marks]
        assert kinds == ["step_begin", "substep_end", "step_end"] * STEPS, (stage, kinds)
        for step in range(STEPS):
            begin, substep, end = (count for _, count in marks[3 * step:3 * step + 3])
            # The first micro-batch runs under no_sync: no gradient collective at all.
            assert substep == begin, (stage, step, marks)
            # The last one reduces every element once, fp32: Psi x 4 bytes, whatever the stage, and the
            # step all-reduces the norm's two float64.
            assert end - substep == psi * 4 + NORM_BYTES, (stage, step, end - substep, psi * 4)
