"""The main job's closing table, its JSON, the loss-curve PNG and the generated sample.

Every figure is computed from what the two training phases measured (``phase-*.json``) plus the
checkpoint on disk; the formulas are the ZeRO paper's, generalised to the dtypes in use by
:func:`plait.zero_sharding.zero_formula_bytes`. Two rows show that the model learns more than
letter frequencies: its final loss against the corpus's unigram entropy (the loss of a model that
knows only how often each byte occurs), and the share of the sample's words that are words of the
corpus, against a sample drawn from those letter frequencies alone.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from plait.kernels.bench import BenchRow, format_table
from plait.kernels.testing import (
    ByteTokenizer,
    conditional_entropy,
    corpus_tokens,
    corpus_words,
    text_words,
    tiny_llama,
)
from plait.lightning.checkpoint import checkpoint_bytes, consolidated_state_dict, export_weights
from plait.lightning.config import NAMES, PRECISIONS
from plait.lightning.demo import sample_text
from plait.zero_sharding import zero_formula_bytes

ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
# The learning targets of a full run (not --quick). A model that has learned only the letter
# frequencies sits at the unigram entropy (2.92 nats on the built-in corpus); one that has learned
# only letter pairs at the bigram entropy (2.15). Ending a full nat below the unigram entropy is
# below both, so the model uses more than the previous byte.
LEARNED_NATS = 1.0
SAMPLE_BYTES = 128  # about 20 words: enough for the share of corpus words to mean something
SAMPLE_WORD_SHARE = 0.5  # a letter-frequency sample of the same length scores about 0.05
MIN_SAMPLE_WORDS = 10


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


def letter_frequency_sample(length: int, *, seed: int = 0) -> str:
    """``length`` bytes drawn independently from the built-in corpus's byte frequencies: what a model
    that learned only the letter frequencies would write (the peer of the sample row).

    Args:
        length: bytes to draw.
        seed: sampling seed.

    Returns:
        The bytes as text (broken UTF-8 replaced).
    """
    counts = torch.bincount(corpus_tokens(), minlength=256)[:256].double()
    generator = torch.Generator().manual_seed(seed)
    return ByteTokenizer().decode(torch.multinomial(counts, length, replacement=True, generator=generator))


def word_counts(text: str) -> tuple[int, int]:
    """(complete words of ``text`` that are words of the built-in corpus, complete words in all)."""
    words = text_words(text, drop_cut_off=True)
    vocabulary = corpus_words()
    return sum(word in vocabulary for word in words), len(words)


def _learning_rows(m: dict[str, Any]) -> list[BenchRow]:
    """Final loss against the unigram entropy, and the sample's corpus words against a
    letter-frequency sample's; without targets in a --quick run (too few steps to hold one)."""
    targets = m["learning_targets"]
    below = m["unigram_entropy"] - m["loss_end"]
    hits, words = m["sample_corpus_words"], m["sample_words"]
    peer_hits, peer_words = m["letters_corpus_words"], m["letters_words"]
    share, peer_share = hits / max(1, words), peer_hits / max(1, peer_words)
    quick = "" if targets else "; --quick: no target"
    return [
        _row("learning past letter frequencies", "final loss (nats)", m["loss_end"], "unigram entropy",
             m["unigram_entropy"], m["loss_end"] / m["unigram_entropy"],
             f"<= unigram - {LEARNED_NATS:g}" if targets else "", below >= LEARNED_NATS if targets else None,
             f"{below:.2f} below; letter pairs (bigram) {m['bigram_entropy']:.3f}{quick}"),
        _row("sample, resumed checkpoint", "corpus words (share)", share, "letter frequencies", peer_share,
             share / peer_share if peer_share else None,
             f">= {SAMPLE_WORD_SHARE:g} of >= {MIN_SAMPLE_WORDS} words" if targets else "",
             share >= SAMPLE_WORD_SHARE and words >= MIN_SAMPLE_WORDS if targets else None,
             f"{hits} of {words} words (peer: {peer_hits} of {peer_words}){quick}"),
    ]


def _rows(report: dict[str, Any]) -> list[BenchRow]:
    m = report
    ok_loss = m["loss_end"] < m["loss_start"]
    return [
        _row("tiny-llama, built-in corpus", "loss (end vs start)", m["loss_end"], "start", m["loss_start"],
                 m["loss_end"] / m["loss_start"], "< 1", ok_loss, f"steps 0-{m['last_step']}"),
        *_learning_rows(m),
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
                 prompt: str, walls: dict[str, float], total_s: float, learning_targets: bool = True) -> dict[str, Any]:
    """Every figure of the table, the sample and the pass/fail verdict as one JSON-able dict.

    Args:
        phases: the ``train`` and ``resume`` phase results.
        checkpoint: the checkpoint saved after the train phase.
        out: the output directory (the final checkpoint and the HF export live there).
        model: the TinyLlamaConfig overrides used.
        prompt: the generation prompt.
        walls: wall seconds of each phase (launch included).
        total_s: seconds since the job started.
        learning_targets: hold the learning rows to their targets (off for ``--quick``).

    Returns:
        The report (JSON-able); ``report["ok"]`` is the verdict.
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
        "sample_prompt": prompt, "sample": sample_text(net, prompt, SAMPLE_BYTES),
        "losses_train": dict(train_losses), "losses_resume": dict(resume_losses),
        "phase_wall_s": walls, "job_wall_s": round(total_s, 1),
    }
    report.update(_learning_figures(report["sample"][len(prompt):], learning_targets))
    if world == 1:
        report["comm_bytes_formula"] = report["comm_bytes_ddp"] = 1.0  # nothing to communicate; avoid 0/0
    finite = all(math.isfinite(v) for _, v in train_losses + resume_losses)
    report["rows"] = [dataclasses.asdict(row) for row in _rows(report)]
    report["ok"] = verdict(report["rows"], finite=finite)
    return report


def _learning_figures(continuation: str, targets: bool) -> dict[str, Any]:
    """The corpus's entropies and the word counts of the sample's continuation and of its peer."""
    tokens = corpus_tokens().tolist()
    hits, words = word_counts(continuation)
    letters = letter_frequency_sample(len(continuation.encode("utf-8")))
    peer_hits, peer_words = word_counts(letters)
    return {"learning_targets": targets, "unigram_entropy": conditional_entropy(tokens),
            "bigram_entropy": conditional_entropy(tokens, context=1), "sample_words": words,
            "sample_corpus_words": hits, "letters_sample": letters, "letters_words": peer_words,
            "letters_corpus_words": peer_hits}


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


def plot_losses(phases: dict[str, dict[str, Any]], path: Path, *,
                references: dict[str, float] | None = None) -> Path | None:
    """The loss curve: the train phase, the checkpoint, and the resumed phase on 1 process.

    Args:
        phases: the ``train`` and ``resume`` phase results.
        path: where to write the PNG.
        references: horizontal lines to draw, label -> loss (the corpus's entropies).

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
    for (label, value), style in zip((references or {}).items(), ("--", "-.", ":")):
        ax.axhline(value, color="black", linewidth=0.8, linestyle=style, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"tiny-llama, {phases['train']['strategy']}, {phases['train']['precision']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
