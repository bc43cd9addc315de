"""The main job end to end, in its quick form (a 2-layer model, a few steps): both phases, the
checkpoint, the consolidated weights, the table, the JSON and the PNG."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_main_job_quick_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "main-job"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-m", "plait.lightning.main_job", "--quick", "--cpu", "--out", str(out)],
                            env=env, capture_output=True, text=True, timeout=580, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((out / "main-job.json").read_text())
    assert report["ok"] and report["train_world"] == 2 and report["loss_end"] < report["loss_start"]
    assert report["resume_first_step"] == 6 and len(report["losses_resume"]) == 3
    if importlib.util.find_spec("matplotlib"):  # the main-job extra; plait-lightning alone has no plot
        assert (out / "loss.png").stat().st_size > 1000 and "loss.png" in result.stdout
    else:
        assert not (out / "loss.png").exists() and "no PNG" in result.stdout
    assert any((out / "hf").glob("*.safetensors"))
    assert report["sample"].startswith(report["sample_prompt"])
    assert "bytes/rank" in result.stdout and "tokens/s" in result.stdout  # the table is the job's last output


def _figures(**changes: float) -> dict[str, float]:
    """The report figures the table is built from, every target met unless ``changes`` says otherwise."""
    figures = {"loss_start": 5.0, "loss_end": 3.0, "last_step": 8, "train_world": 2, "accelerator": "cpu",
               "tokens_per_s_train": 100.0, "step_time_train_s": 0.1, "tokens_per_s_resume": 50.0,
               "step_time_resume_s": 0.2, "stage": 3, "state_bytes_measured": 1000.0, "state_bytes_ddp": 2000.0,
               "state_bytes_formula": 1000.0, "comm_bytes_measured": 300.0, "comm_bytes_formula": 300.0,
               "comm_bytes_ddp": 400.0, "checkpoint_bytes": 120.0, "raw_state_bytes": 120.0,
               "resume_first_loss": 3.2, "last_train_loss": 3.1, "resume_first_step": 6,
               "learning_targets": True, "unigram_entropy": 4.5, "bigram_entropy": 3.8, "sample_words": 20,
               "sample_corpus_words": 12, "letters_words": 20, "letters_corpus_words": 1}
    return {**figures, **changes}


@pytest.mark.parametrize("miss", [
    {},
    {"state_bytes_measured": 1100.0},  # memory 10% over the ZeRO formula
    {"comm_bytes_measured": 400.0},  # communication over the formula
    {"checkpoint_bytes": 200.0},  # checkpoint bigger than the raw state
    {"resume_first_loss": 9.0},  # resume did not continue the curve
    {"loss_end": 6.0},  # loss went up
    {"loss_end": 3.6},  # fell, but stayed within a nat of the letter frequencies
    {"sample_corpus_words": 8},  # fewer than half the sample's words are corpus words
    {"sample_words": 6, "sample_corpus_words": 6},  # too short a sample to judge
])
def test_main_job_verdict_counts_every_target_row(miss: dict[str, float]) -> None:
    import dataclasses

    from plait.lightning.main_job_report import _rows, verdict

    rows = [dataclasses.asdict(row) for row in _rows(_figures(**miss))]
    assert verdict(rows) is (not miss)
    assert not verdict(rows, finite=False)
    memory = next(row for row in rows if row["figure"] == "bytes/rank")
    assert memory["peer"] == "DDP (formula)"  # a formula is never shown as a measured peer


def test_quick_run_shows_the_learning_rows_without_targets() -> None:
    import dataclasses

    from plait.lightning.main_job_report import _rows, verdict

    rows = [dataclasses.asdict(row) for row in _rows(_figures(learning_targets=False, loss_end=4.4,
                                                              sample_corpus_words=0))]
    learning = [row for row in rows if row["figure"] in ("final loss (nats)", "corpus words (share)")]
    assert len(learning) == 2 and all(row["target"] == "" and row["passed"] is None for row in learning)
    assert verdict(rows)


def test_sample_words_are_counted_against_the_corpus_and_a_letter_frequency_peer() -> None:
    from plait.kernels.testing import corpus_words
    from plait.lightning.main_job_report import letter_frequency_sample, word_counts

    assert {"the", "weaver", "loom"} <= corpus_words()
    assert word_counts("the weaver and the qzx loo") == (4, 5)  # "loo" is cut off at the end: not counted
    letters = letter_frequency_sample(128)
    assert len(letters) == 128 and letters == letter_frequency_sample(128)  # seeded
    hits, words = word_counts(letters)
    assert words >= 10 and hits / words < 0.25  # letter frequencies alone rarely spell a corpus word
