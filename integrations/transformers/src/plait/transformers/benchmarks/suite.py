"""The Trainer benchmark: a tiny Llama fine-tuned through ``transformers.Trainer`` at W=2 (gloo, one
torch thread per rank), plait ZeRO-3 (``with_plait``) against the plain DDP Trainer and against
the Trainer's own DeepSpeed ZeRO-3 route (``deepspeed=``, DeepSpeed's CPU accelerator over gloo).

* step time: one 2-rank run; every round trains each route for ``steps`` optimizer steps with a
  fresh Trainer (plait, DeepSpeed, DDP, in turn), the first two steps of each (set-up, first
  allocations) are dropped; median and p10/p90 of rank 0's steps over every round. Target: plait
  <= DeepSpeed.
* peak memory: one 2-rank run per route (peak RSS is per process, so routes cannot share one);
  the peak resident memory reached during training above the resident memory just before the
  model is built (``/proc/self/clear_refs`` resets the peak there), the larger of the two ranks.
  Target: plait <= DeepSpeed.

The loss of each route's first and last steps is in the notes: the three routes train the same
model on the same data and must agree.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from plait.kernels.bench import BenchRow, TimingStats, reset_peak_rss, rss_bytes, timing_row
from plait.kernels.testing import run_distributed

ROUTES = ("plait", "deepspeed", "ddp")
NAMES = {"plait": "plait ZeRO-3", "deepspeed": "DeepSpeed ZeRO-3", "ddp": "DDP"}
# (model overrides, sequence length, per-rank batch, steps per round, rounds)
QUICK = (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1024), 64, 4, 8, 3)
FULL = (dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, vocab_size=8192,
             max_position_embeddings=128), 128, 4, 10, 3)
WARMUP_STEPS = 2  # dropped from every run: set-up, first allocations, the allocator settling
ENV = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator (ranks inherit it)


def _deepspeed_ready() -> None:
    """Import DeepSpeed for its CPU accelerator without building its shared-memory C++ op (the
    transport is gloo for every route)."""
    import deepspeed  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None




def _run_route(route: str, tmp: str, setup: tuple, *, steps: int) -> Any:
    from plait.transformers.demo import TokenDataset, train

    overrides, seq, batch, _, _ = setup
    data = TokenDataset(count=steps * batch * 2, seq_len=seq, vocab_size=overrides["vocab_size"])
    if route == "deepspeed":
        _deepspeed_ready()
    return train(route, tempfile.mkdtemp(dir=tmp), plait={"zero": {"stage": 3}}, model_overrides=overrides,
                 dataset=data, max_steps=steps, per_device_train_batch_size=batch, max_grad_norm=1.0)


def timing_worker(tmp: str, setup: tuple) -> dict[str, Any]:
    """One rank of the timing run: every route in turn, ``rounds`` times."""
    *_, steps, rounds = setup
    seconds: dict[str, list[float]] = {route: [] for route in ROUTES}
    losses: dict[str, tuple[float, ...]] = {}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for route in ROUTES:
            if route in errors:
                continue
            try:
                result = _run_route(route, tmp, setup, steps=steps)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run becomes a row with the reason
                errors[route] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            seconds[route].extend(result.step_seconds[WARMUP_STEPS:])
            losses[route] = result.losses
    return {"seconds": seconds, "losses": losses, "errors": errors}


def memory_worker(tmp: str, setup: tuple, route: str) -> int:
    """One rank of a memory run: peak resident bytes above the level before the model is built."""
    if route == "deepspeed":
        _deepspeed_ready()
    import transformers  # noqa: F401 - imports are not the route's memory

    import plait.transformers  # noqa: F401

    base = reset_peak_rss()
    _run_route(route, tmp, setup, steps=setup[3])
    return rss_bytes()[1] - base


def _loss_note(losses: dict[str, tuple[float, ...]], route: str) -> str:
    def span(name: str) -> str:
        values = losses.get(name)
        return f"{values[0]:.4f}/{values[-1]:.4f}" if values else "-"

    return f"loss first/last ours {span('plait')}, peer {span(route)}"


def _memory_row(setup_name: str, ours: int | None, peer: int | None, route: str, note: str) -> BenchRow:
    mib = 1 / (1 << 20)
    target = route == "deepspeed"
    if ours is None or peer is None:
        return BenchRow(benchmark=f"Trainer {setup_name} W=2", figure="peak RSS growth (MiB)",
                        ours=(ours or 0) * mib, peer=NAMES[route], note=note or "peer unavailable")
    ratio = ours / peer
    return BenchRow(benchmark=f"Trainer {setup_name} W=2", figure="peak RSS growth (MiB)", ours=ours * mib,
                    peer=NAMES[route], peer_value=peer * mib, ratio=ratio, target="<= 1" if target else "",
                    passed=(ratio <= 1.0) if target else None, note=note)


def run(quick: bool) -> list[BenchRow]:
    """The rows of ``plait bench transformers`` (see the module docstring).

    Args:
        quick: the small model (about a minute on 2 CPU cores) instead of the full one.
    """
    setup = QUICK if quick else FULL
    name = "llama h{hidden_size} L{num_hidden_layers} V{vocab_size}".format(**setup[0]) + f" seq{setup[1]}"
    rows: list[BenchRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        timing = run_distributed(timing_worker, 2, tmp, setup, timeout=1200, env=ENV)[0]
        memory: dict[str, int | None] = {}
        memory_errors: dict[str, str] = {}
        for route in ROUTES:
            try:
                memory[route] = max(run_distributed(memory_worker, 2, tmp, setup, route, timeout=600, env=ENV))
            except Exception as exc:  # noqa: BLE001 - reported in the row
                memory[route], memory_errors[route] = None, f"{type(exc).__name__}"[:200]
    stats = {r: TimingStats.of(s) for r, s in timing["seconds"].items() if s}
    for route in ("deepspeed", "ddp"):
        note = timing["errors"].get(route, _loss_note(timing["losses"], route))
        row = timing_row(f"Trainer {name} W=2", stats["plait"], NAMES[route], stats.get(route),
                         target_ratio=1.0 if route == "deepspeed" else None, figure="step time (ms)")
        rows.append(BenchRow(**{**row.__dict__, "note": "; ".join(p for p in (row.note, note) if p)}))
    for route in ("deepspeed", "ddp"):
        rows.append(_memory_row(name, memory["plait"], memory[route], route, memory_errors.get(route, "")))
    return rows


if __name__ == "__main__":
    from plait.kernels.bench import format_table

    os.environ.update(ENV)
    print(format_table(run(quick="--quick" in sys.argv)))
