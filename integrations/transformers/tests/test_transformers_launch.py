"""The route that needs no code change: ``PLAIT_CONFIG=... python -m plait.transformers.launch script.py``
runs an unedited Trainer script on plait (here one process, started without torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = '''
import json, sys
import transformers
from plait.transformers.demo import TokenDataset, tiny_llama_model, training_args

trainer = transformers.Trainer(model=tiny_llama_model(), args=training_args(sys.argv[1], max_steps=2),
                               train_dataset=TokenDataset(16))
trainer.train()
print("RESULT " + json.dumps({"trainer": type(trainer).__name__, "model": type(trainer.model).__name__,
                              "stage": trainer.plait_config.zero.stage}))
'''


def _launch(tmp_path: Path, config: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PLAIT_CONFIG": config}
    return subprocess.run([sys.executable, "-m", "plait.transformers.launch", str(script), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=240)


def test_unedited_script_trains_on_plait(tmp_path: Path) -> None:
    config = tmp_path / "plait.json"
    config.write_text(json.dumps({"zero": {"stage": 2}}))
    done = _launch(tmp_path, str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == {"trainer": "PlaitTrainer", "model": "ZeroLlamaForCausalLM",
                                                 "stage": 2}


def test_a_bad_config_stops_before_the_script_runs(tmp_path: Path) -> None:
    done = _launch(tmp_path, '{"zero": {"stage": 3}, "ofload": "cpu"}')
    assert done.returncode != 0
    assert "unknown key(s) ['ofload']" in done.stderr
    assert not (tmp_path / "out").exists()
