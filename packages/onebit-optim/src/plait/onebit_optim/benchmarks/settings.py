"""The freeze settings that used to diverge, on two models (``plait bench onebit-optim-settings``).

``plait bench onebit-optim-quality`` checks the optimizers under ZeRO with one setting each, chosen
to train. This suite runs the settings a user is likely to try, including the short ones that
diverged before the variance floor existed, in plain data parallel at W=2 (the README's usage):

* 1-bit Adam with ``freeze_step`` 2, 3 and ``"auto"`` (default :class:`SettleConfig`), against
  AdamW on gradients averaged as DDP does (what 1-bit Adam's warm-up is, bit for bit);
* 0/1 Adam with the short schedule of the timing benchmark (``var_freeze_step=3,
  var_update_scaler=3, local_step_scaler=1, local_step_clipper=4``) and with DeepSpeed's variance
  and local-step schedule (its defaults ``var_update_scaler=16, local_step_scaler=32678,
  local_step_clipper=16``; ``var_freeze_step`` at half the run, since DeepSpeed's 100,000 never
  comes in a short run), each against the same optimizer at W=1, where nothing is compressed
  (0/1 Adam has no bias correction, so AdamW would measure the algorithm, not the compression).
  ``betas=(0.9, 0.99)`` as in the timing benchmark (:mod:`.worker`: with 0.999 and few variance
  updates its steps are many times Adam's).

Models:

* ``tiny-llama``: the quality benchmark's (vocabulary 259, width 64, 2 layers), the package's text
  corpus, a global batch of 8 x 32 tokens, lr 1e-3, 300 steps (quick: 60);
* ``lm-27.3M``: ``tiny_llama`` with an 8192-token vocabulary, width 512, 6 layers (27.4M
  parameters), uniformly random tokens, one sequence of 64 tokens per rank, lr 3e-4, 60 steps
  (quick: 30). With random tokens most embedding rows are first seen after the variance froze:
  the case the variance floor exists for. The loss cannot fall much below ln 8192 = 9.01, so the
  rows of this model say whether a setting stays stable, not how well it learns.

Weight decay 0.01 everywhere. Figure: the final loss, the mean of the global mean loss of the last
20 steps (tiny-llama) or 10 (lm-27.3M). Target: within 2% of the reference, on both sides. A run
that stops with the optimizers' non-finite error gets its row with the error and fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from plait.kernels.bench import BenchRow

TOLERANCE = 0.02
WORLD = 2
MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"config": dict(vocab_size=259, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                                  max_seq_len=32),
                   "batch": 8, "seq": 32, "lr": 1e-3, "steps": 300, "quick_steps": 60, "tail": 20, "random": False},
    "lm-27.3M": {"config": dict(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1376,
                                max_seq_len=64),
                 "batch": 2, "seq": 64, "lr": 3e-4, "steps": 60, "quick_steps": 30, "tail": 10, "random": True},
}
# setting -> (reference setting, world size of the reference)
SETTINGS = {
    "onebit_adam freeze_step=2": ("adamw", WORLD),
    "onebit_adam freeze_step=3": ("adamw", WORLD),
    "onebit_adam freeze_step=auto": ("adamw", WORLD),
    "zero_one_adam short schedule": ("zero_one_adam short schedule", 1),
    "zero_one_adam DeepSpeed's schedule": ("zero_one_adam DeepSpeed's schedule", 1),
}
REFERENCE_NAMES = {"adamw": "AdamW (DDP averaging), W=2", "zero_one_adam short schedule": "the same at W=1",
                   "zero_one_adam DeepSpeed's schedule": "the same at W=1"}


def run(quick: bool) -> list[BenchRow]:
    """Run every setting on both models (see the module docstring).

    Args:
        quick: fewer steps (60 and 30).

    Returns:
        One row per model and setting.
    """
    from plait.kernels.testing import run_distributed

    rows = []
    for model, spec in MODELS.items():
        steps = spec["quick_steps"] if quick else spec["steps"]
        cache: dict[tuple[str, int], dict[str, Any]] = {}
        for setting, (reference, ref_world) in SETTINGS.items():
            for name, world in ((setting, WORLD), (reference, ref_world)):
                if (name, world) not in cache:
                    cache[name, world] = _run(run_distributed, model, name, world, steps)
                    _say(f"{model} {name} W={world}: {cache[name, world]}")
            rows.append(_row(model, setting, steps, cache[setting, WORLD], reference, cache[reference, ref_world]))
    return rows


def _run(run_distributed: Any, model: str, setting: str, world: int, steps: int) -> dict[str, Any]:
    """One run's final loss and freeze step, or the error it stopped with."""
    try:
        losses, freeze = run_distributed(_train, world, model, setting, steps, timeout=3600)[0]
    except Exception as error:  # noqa: BLE001 - a diverged run is a row of the table, not a crash
        lines = [line for line in str(error).splitlines() if "Error" in line]
        return {"final": float("nan"), "error": (lines[-1] if lines else str(error).splitlines()[0])[:300]}
    tail = MODELS[model]["tail"]
    return {"final": sum(losses[-tail:]) / tail, "freeze": freeze}


def _row(model: str, setting: str, steps: int, ours: dict[str, Any], reference: str,
         peer: dict[str, Any]) -> BenchRow:
    ratio = ours["final"] / peer["final"]
    notes = []
    if setting.endswith("auto") and "freeze" in ours:
        notes.append(f"froze after step {ours['freeze']}" if ours["freeze"] is not None else
                     f"the variance did not settle within {steps} steps: nothing was compressed")
    notes += [f"stopped: {r['error']}" for r in (ours, peer) if "error" in r]
    return BenchRow(benchmark=f"{setting}, W={WORLD}, {model} {steps} steps",
                    figure=f"final loss (mean of last {MODELS[model]['tail']})", ours=ours["final"],
                    peer=REFERENCE_NAMES[reference], peer_value=peer["final"], ratio=ratio,
                    target=f"within {TOLERANCE:.0%}", passed=bool(abs(ratio - 1) <= TOLERANCE),
                    note="; ".join(notes))


def _say(message: str) -> None:
    print(f"onebit-optim-settings: {message}", flush=True, file=sys.stderr)


def _train(model_name: str, setting: str, steps: int) -> tuple[list[float], int | None]:
    """One run on every rank: the global mean loss of each step, and the step the variance froze after."""
    import torch.distributed as dist

    spec = MODELS[model_name]
    model, optimizer = _build(model_name, setting, steps)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        ids = _batch(spec, step)[rank * spec["batch"] // world:(rank + 1) * spec["batch"] // world]
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / world).tolist(), getattr(optimizer, "freeze_step", None)


def _batch(spec: dict[str, Any], step: int) -> torch.Tensor:
    """The global batch of a step, ``[batch, seq + 1]`` token ids, the same on every rank."""
    if spec["random"]:
        generator = torch.Generator().manual_seed(step)
        return torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"] + 1), generator=generator)
    from plait.kernels.testing import global_batch

    batch = global_batch(step, spec["batch"], spec["seq"])
    return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)


def _build(model_name: str, setting: str, steps: int) -> tuple[torch.nn.Module, Any]:
    from plait.kernels.testing import tiny_llama
    from plait.onebit_optim import OnebitAdam, OnebitAdamConfig, ZeroOneAdam, ZeroOneAdamConfig

    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = tiny_llama(**spec["config"])
    params, lr = list(model.parameters()), spec["lr"]
    if setting == "adamw":
        return model, _AveragedAdamW(params, lr)
    if setting.startswith("onebit_adam"):
        freeze: int | str = setting.rsplit("=", 1)[1]
        freeze = freeze if freeze == "auto" else int(freeze)
        return model, OnebitAdam(params, lr=lr, weight_decay=0.01, config=OnebitAdamConfig(freeze_step=freeze))
    schedule = (dict(var_freeze_step=3, var_update_scaler=3, local_step_scaler=1, local_step_clipper=4)
                if setting.endswith("short schedule") else dict(var_freeze_step=steps // 2))
    return model, ZeroOneAdam(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01,
                              config=ZeroOneAdamConfig(**schedule))


class _AveragedAdamW:
    """``torch.optim.AdamW`` on gradients averaged with DDP's arithmetic (1-bit Adam's reference)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        self.params = params
        self.adamw = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)

    def step(self) -> None:
        """Average the gradients over the ranks, then one AdamW step."""
        from plait.onebit_optim.exchange.compressed import average_gradients

        average_gradients([p.grad for p in self.params])
        self.adamw.step()

    def zero_grad(self) -> None:
        """As the optimizer's."""
        self.adamw.zero_grad()


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--out PATH`` (required), ``--quick``; the same rows as ``plait bench``."""
    from plait.kernels.bench import format_table, load_average, run_meta, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    load_before = load_average()
    rows = run(args.quick)
    print(format_table(rows))
    command = "python -m plait.onebit_optim.benchmarks.settings" + (" --quick" if args.quick else "")
    meta = run_meta(command, load_before, suite="onebit-optim-settings", quick=args.quick)
    print(f"\nwrote {write_json(rows, args.out, meta=meta)}")
    return 1 if any(row.passed is False for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
