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
