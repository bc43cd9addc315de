"""``plait bench lightning``: the Lightning Trainer on 2 CPU ranks (gloo, one torch thread per
rank), ``plait_zero2`` and ``plait_zero3`` against ``ddp`` and FSDP2 (Lightning's
``ModelParallelStrategy`` with ``fully_shard`` on every block and the root), same model, data,
seed and AdamW.

* step time: one 2-rank run; every round fits each strategy for ``steps`` optimizer steps with a
  fresh Trainer (ABBA: A B C D, then D C B A, ...), the first ``WARMUP_STEPS`` of each fit
  dropped; median and p10/p90 of rank 0's step times over every round. Targets: stage 2 <=
  stage 3 (stage 2 moves fewer bytes), stage 3 <= 0.8x FSDP2 and <= 1.05x DDP, each held by the
  p90 of the ratio of the same step in the same round (``plait.kernels.bench.timing_row``).
* peak memory: one 2-rank fit per strategy (peak RSS is per process); the growth of the peak
  resident memory above the level just before the Trainer starts (``/proc/self/clear_refs``
  resets the peak there), the larger of the two ranks.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from plait.kernels.bench import BenchRow, TimingStats, reset_peak_rss, rss_bytes, timing_row
from plait.kernels.testing import run_distributed

STRATEGIES = ("plait_zero2", "plait_zero3", "ddp", "fsdp2")
# (tiny-llama overrides, global batch, sequence length, steps per fit, rounds)
FULL = (dict(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1376), 8, 128, 8, 3)
QUICK = (dict(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, intermediate_size=344), 4, 32, 6, 2)
WARMUP_STEPS = 2  # dropped from every fit: set-up, first allocations


def _module_class() -> type:
    """The demo module, made to build its network in ``configure_model`` and, under FSDP2
    (``ModelParallelStrategy``), to ``fully_shard`` every block and the root there."""
    from plait.lightning.demo import TinyLlamaModule

    class BenchModule(TinyLlamaModule):
        def configure_model(self) -> None:
            fresh = self.model is None
            super().configure_model()
            mesh = getattr(self, "device_mesh", None)
            if fresh and mesh is not None:  # ModelParallelStrategy hands the module its mesh
                from torch.distributed.fsdp import fully_shard

                dp = mesh["data_parallel"]
                for block in self.model.layers:
                    fully_shard(block, mesh=dp)
                fully_shard(self.model, mesh=dp)

        def configure_optimizers(self) -> Any:
            # fused AdamW needs plain tensors; FSDP2's parameters are DTensors
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)

    return BenchModule


def _step_timer() -> Any:
    """A Lightning callback keeping the wall seconds of every optimizer step (``.seconds``)."""
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.seconds.append(time.perf_counter() - self._start)

    return StepTimer()


def _strategy(name: str) -> Any:
    if name != "fsdp2":
        return name
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def _fit(name: str, setup: tuple, steps: int) -> tuple[list[float], float]:
    """One fit of ``steps`` steps; returns the step seconds and the last loss."""
    import lightning as L

    import plait.lightning  # noqa: F401 - registers the plait_* names
    from plait.lightning.demo import LossRecorder

    overrides, batch, seq, *_ = setup
    L.seed_everything(0, verbose=False)
    module = _module_class()(overrides, batch_size=batch, seq_len=seq, warmup=1, total_steps=steps,
                             in_configure_model=True)
    timer, losses = _step_timer(), LossRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(name), max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[timer, losses])
    trainer.fit(module)
    return timer.seconds, losses.losses[max(losses.losses)]


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)


def timing_worker(setup: tuple) -> dict[str, Any]:
    """One rank of the timing run: every strategy in turn, ``rounds`` times."""
    _quiet()
    *_, steps, rounds = setup
    seconds: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    losses: dict[str, float] = {}
    errors: dict[str, str] = {}
    for round_ in range(rounds):
        # ABBA: every other round runs the strategies in reverse, so load drift falls on all alike.
        for name in STRATEGIES if round_ % 2 == 0 else STRATEGIES[::-1]:
            if name in errors:
                continue
            try:
                times, loss = _fit(name, setup, steps)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run becomes a row with the reason
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            seconds[name].extend(times[WARMUP_STEPS:])
            losses[name] = loss
    return {"seconds": seconds, "losses": losses, "errors": errors}




def memory_worker(setup: tuple, name: str) -> int:
    """One rank of a memory run: peak resident bytes above the level before the Trainer starts."""
    _quiet()
    import lightning  # noqa: F401 - imports are not the strategy's memory

    import plait.lightning  # noqa: F401

    base = reset_peak_rss()
    _fit(name, setup, setup[3])
    return rss_bytes()[1] - base


def _params(setup: tuple) -> int:
    from plait.kernels.testing import tiny_llama

    with torch.device("meta"):
        return sum(p.numel() for p in tiny_llama(**setup[0]).parameters())


def run(quick: bool) -> list[BenchRow]:
    """The rows of ``plait bench lightning`` (see the module docstring).

    Args:
        quick: a 2-layer model (well under a minute) instead of the 27M-parameter one.
    """
    setup = QUICK if quick else FULL
    name = f"tiny-llama {_params(setup) / 1e6:.1f}M fp32, batch {setup[1]}x{setup[2]}, Lightning W=2"
    timing = run_distributed(timing_worker, 2, setup, timeout=1800)[0]
    stats = {s: TimingStats.of(v) for s, v in timing["seconds"].items() if v}
    errors = timing["errors"]

    def step_row(ours: str, peer: str, target: float | None) -> BenchRow:
        if ours not in stats:
            return BenchRow(benchmark=f"{name}, {ours}", figure="step time (ms)", ours=float("nan"),
                            peer=peer, note=f"not run: {errors.get(ours, 'no timings')}")
        row = timing_row(f"{name}, {ours}", stats[ours], peer, stats.get(peer), target_ratio=target,
                         figure="step time (ms)")
        if peer not in stats:
            row = BenchRow(**{**row.__dict__, "note": f"peer n/a: {errors.get(peer, 'no timings')}"})
        losses = timing["losses"]
        note = f"last loss ours {losses.get(ours, float('nan')):.4f}, peer {losses.get(peer, float('nan')):.4f}"
        return BenchRow(**{**row.__dict__, "note": "; ".join(p for p in (row.note, note) if p)})

    rows = [step_row("plait_zero2", "plait_zero3", 1.0), step_row("plait_zero2", "ddp", None),
            step_row("plait_zero3", "ddp", 1.05), step_row("plait_zero3", "fsdp2", 0.8)]
    memory: dict[str, float | None] = {}
    for strategy in STRATEGIES:
        try:
            memory[strategy] = max(run_distributed(memory_worker, 2, setup, strategy, timeout=900)) / 2**20
        except Exception as exc:  # noqa: BLE001 - reported in the row
            memory[strategy], errors[f"{strategy}:memory"] = None, f"{type(exc).__name__}"
    for ours in ("plait_zero2", "plait_zero3"):
        for peer in ("ddp", "fsdp2"):
            if memory[ours] is None:
                rows.append(BenchRow(benchmark=f"{name}, {ours}", figure="peak RSS growth (MiB)", ours=float("nan"),
                                     peer=peer, note=f"not run: {errors[f'{ours}:memory']}"))
            elif memory[peer] is None:
                rows.append(BenchRow(benchmark=f"{name}, {ours}", figure="peak RSS growth (MiB)",
                                     ours=memory[ours], peer=peer, note=f"peer n/a: {errors[f'{peer}:memory']}"))
            else:
                rows.append(BenchRow(benchmark=f"{name}, {ours}", figure="peak RSS growth (MiB)",
                                     ours=memory[ours], peer=peer, peer_value=memory[peer],
                                     ratio=memory[ours] / memory[peer]))
    return rows


if __name__ == "__main__":
    from plait.kernels.bench import format_table

    print(format_table(run(quick="--quick" in sys.argv)))
