"""The main job's closing table, its JSON, the loss-curve PNG and the generated sample.

Every figure is computed from what the two training phases measured (``phase-*.json``) plus the
checkpoint on disk; the formulas are the ZeRO paper's, generalised to the dtypes in use by
:func:`plait.zero_sharding.zero_formula_bytes`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from plait.kernels.bench import BenchRow, format_table
from plait.kernels.testing import tiny_llama
from plait.lightning.checkpoint import checkpoint_bytes, consolidated_state_dict, export_weights
from plait.lightning.config import NAMES, PRECISIONS
from plait.lightning.demo import sample_text
from plait.zero_sharding import zero_formula_bytes

ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


def _losses(phase: dict[str, Any]) -> list[tuple[int, float]]:
    return sorted((int(step), float(value)) for step, value in phase["losses"].items())


def communication_formula(num_params: int, stage: int, precision: str) -> float:
    """Logical bytes per step predicted by the ZeRO paper (all-reduce counted as RS + AG):
    stage 1/2 reduce-scatter gradients and all-gather parameters (2 Psi), stage 3 gathers
    parameters for forward and again for backward (3 Psi), each in its own dtype."""
    plan = PRECISIONS[precision]
    p = torch.empty((), dtype=plan.compute_dtype).element_size()
    g = torch.empty((), dtype=plan.reduce_dtype).element_size()
    return float(num_params * (g + (2 * p if stage == 3 else p)))


_FIELDS = ("benchmark", "figure", "ours", "peer", "peer_value", "ratio", "target", "passed", "note")


def _row(*values: Any, **named: Any) -> BenchRow:
    """A BenchRow from values in its field order (the table reads better that way)."""
    return BenchRow(**dict(zip(_FIELDS, values)), **named)


def _rows(report: dict[str, Any]) -> list[BenchRow]:
    m = report
    ok_loss = m["loss_end"] < m["loss_start"]
    return [
        _row("tiny-llama, built-in corpus", "loss (end vs start)", m["loss_end"], "start", m["loss_start"],
                 m["loss_end"] / m["loss_start"], "< 1", ok_loss, f"steps 0-{m['last_step']}"),
        _row(f"train, {m['train_world']} x {m['accelerator']}", "tokens/s", m["tokens_per_s_train"],
                 note=f"median step {m['step_time_train_s'] * 1e3:.0f} ms"),
        _row("resumed, 1 process", "tokens/s", m["tokens_per_s_resume"],
                 note=f"median step {m['step_time_resume_s'] * 1e3:.0f} ms"),
        _row(f"model state, stage {m['stage']}", "bytes/rank", m["state_bytes_measured"], "DDP (formula)",
                 m["state_bytes_ddp"], m["state_bytes_measured"] / m["state_bytes_ddp"],
                 "formula +-2%", abs(m["state_bytes_measured"] / m["state_bytes_formula"] - 1) <= 0.02,
                 f"ZeRO formula {m['state_bytes_formula']:.4g}"),
        _row(f"communication, stage {m['stage']}", "bytes/step", m["comm_bytes_measured"], "ZeRO formula",
                 m["comm_bytes_formula"], m["comm_bytes_measured"] / m["comm_bytes_formula"], "<= 1.02",
                 m["comm_bytes_measured"] <= 1.02 * m["comm_bytes_formula"], f"DDP formula {m['comm_bytes_ddp']:.4g}"),
        _row("universal checkpoint", "bytes on disk", m["checkpoint_bytes"], "raw state", m["raw_state_bytes"],
                 m["checkpoint_bytes"] / m["raw_state_bytes"], "<= 1.05",
                 m["checkpoint_bytes"] <= 1.05 * m["raw_state_bytes"], "fp32 masters + Adam moments"),
        _row("resume 2 -> 1 process", "first resumed loss", m["resume_first_loss"], "last saved",
                 m["last_train_loss"], m["resume_first_loss"] / m["last_train_loss"], "< 1.1",
                 m["resume_first_loss"] < 1.1 * m["last_train_loss"], f"step {m['resume_first_step']}"),
    ]


def build_report(phases: dict[str, dict[str, Any]], checkpoint: Path, out: Path, *, model: dict[str, Any],
                 prompt: str, walls: dict[str, float], total_s: float) -> dict[str, Any]:
    """Every figure of the table, the sample and the pass/fail verdict as one JSON-able dict.

    Args:
        phases: the ``train`` and ``resume`` phase results.
        checkpoint: the checkpoint saved after the train phase.
        out: the output directory (the final checkpoint and the HF export live there).
        model: the TinyLlamaConfig overrides used.
        prompt: the generation prompt.
        walls: wall seconds of each phase (launch included).
        total_s: seconds since the job started.
    """
    train, resume = phases["train"], phases["resume"]
    stage = NAMES[train["strategy"]][0] if train["strategy"] in NAMES else 3
    precision, psi, world = train["precision"], int(train["num_params"]), int(train["world_size"])
    plan = PRECISIONS[precision]
    train_losses, resume_losses = _losses(train), _losses(resume)
    final = out / "checkpoint-final"
    weights = consolidated_state_dict(final, strip="model.")
    net = tiny_llama(**model)
    net.load_state_dict(weights)
    net.eval()
    hf_dir = export_weights(final, out / "hf", strip="model.")
    report: dict[str, Any] = {
        "strategy": train["strategy"], "stage": stage, "precision": precision, "accelerator": train["accelerator"],
        "train_world": world, "num_params": psi, "model": model,
        "loss_start": train_losses[0][1], "loss_end": resume_losses[-1][1], "last_step": resume_losses[-1][0],
        "last_train_loss": train_losses[-1][1], "resume_first_loss": resume_losses[0][1],
        "resume_first_step": resume_losses[0][0], "val_loss_end": resume["val_loss"],
        "tokens_per_s_train": train["tokens_per_step"] / train["step_time_s"],
        "tokens_per_s_resume": resume["tokens_per_step"] / resume["step_time_s"],
        "step_time_train_s": train["step_time_s"], "step_time_resume_s": resume["step_time_s"],
        "state_bytes_measured": train["state_bytes"]["total"], "state_bytes_by_kind": train["state_bytes"],
        "state_bytes_formula": zero_formula_bytes(psi, stage=stage, world_size=world,
                                                  compute_dtype=plan.compute_dtype, grad_dtype=plan.reduce_dtype,
                                                  optimizer_state_bytes=ADAM_STATE_BYTES),
        "state_bytes_ddp": float(psi * (4 + 4 + ADAM_STATE_BYTES)),
        "comm_bytes_measured": train["volume_per_step"],
        "comm_bytes_formula": communication_formula(psi, stage, precision) if world > 1 else 0.0,
        "comm_bytes_ddp": float(2 * psi * 4) if world > 1 else 0.0,
        "checkpoint_bytes": checkpoint_bytes(checkpoint), "raw_state_bytes": float(psi * (4 + ADAM_STATE_BYTES)),
        "hf_export_bytes": sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors")),
        "sample_prompt": prompt, "sample": sample_text(net, prompt, 64),
        "losses_train": dict(train_losses), "losses_resume": dict(resume_losses),
        "phase_wall_s": walls, "job_wall_s": round(total_s, 1),
    }
    if world == 1:
        report["comm_bytes_formula"] = report["comm_bytes_ddp"] = 1.0  # nothing to communicate; avoid 0/0
    finite = all(math.isfinite(v) for _, v in train_losses + resume_losses)
    report["rows"] = [dataclasses.asdict(row) for row in _rows(report)]
    report["ok"] = verdict(report["rows"], finite=finite)
    return report


def verdict(rows: list[dict[str, Any]], *, finite: bool = True) -> bool:
    """The job's pass/fail: finite losses and every row that has a target meets it (loss, memory,
    communication, checkpoint size and resume alike); rows without a target do not count."""
    return finite and all(bool(row["passed"]) for row in rows if row["target"])


def print_report(report: dict[str, Any]) -> None:
    """The table and the sample, as the job's last output."""
    rows = [BenchRow(**row) for row in report["rows"]]
    print("\n" + format_table(rows))
    print(f"\nsample (top-k, from the resumed checkpoint): {report['sample']!r}")
    print(f"job wall time {report['job_wall_s']:.0f} s (phases: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in report["phase_wall_s"].items()) + ")")


def plot_losses(phases: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """The loss curve: the train phase, the checkpoint, and the resumed phase on 1 process.

    Returns:
        ``path``, or ``None`` when matplotlib is not installed (the JSON has the same numbers).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plait train: matplotlib is not installed, so no PNG (pip install matplotlib).")
        return None
    train, resume = _losses(phases["train"]), _losses(phases["resume"])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([s for s, _ in train], [v for _, v in train], label=f"{phases['train']['world_size']} processes")
    ax.plot([s for s, _ in resume], [v for _, v in resume], label="resumed on 1 process")
    ax.axvline(train[-1][0] + 0.5, color="grey", linestyle=":", label="universal checkpoint")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"tiny-llama, {phases['train']['strategy']}, {phases['train']['precision']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
