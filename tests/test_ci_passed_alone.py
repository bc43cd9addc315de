"""CI's passed-alone plugin (ci/passed_alone.py): what passed installed alone is recorded and not
run again; what skipped, failed, xfailed or errored in teardown there still runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CI = Path(__file__).resolve().parents[1] / "ci"

SAMPLE = '''
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("an extra is absent")

@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown")

def test_teardown_errors(bad_teardown):
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1
'''


def _pytest(folder: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    full_env.update(PYTHONPATH=str(CI), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "passed_alone", "-p", "no:cacheprovider",
                           "-c", os.devnull, "--rootdir", str(folder), "test_sample.py"],
                          cwd=folder, env=full_env, capture_output=True, text=True, timeout=120)


def test_only_what_passed_is_recorded_and_then_deselected(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    record = tmp_path / "passed" / "plait-sample.txt"
    first = _pytest(tmp_path, PLAIT_RECORD_PASSED=str(record))
    assert first.returncode == 1, first.stdout  # test_param[2] fails, and the teardown errors
    assert record.read_text().split() == ["test_sample.py::test_passes", "test_sample.py::test_param[1]"]
    second = _pytest(tmp_path, PLAIT_SKIP_PASSED=str(record.parent))
    summary = second.stdout.strip().splitlines()[-1]
    assert "2 deselected" in summary and "1 skipped" in summary and "1 xfailed" in summary, second.stdout
    assert "1 failed" in summary and "1 error" in summary, second.stdout


def test_a_missing_record_folder_is_refused_by_name(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    result = _pytest(tmp_path, PLAIT_SKIP_PASSED=str(tmp_path / "nowhere"))
    assert result.returncode != 0 and "PLAIT_SKIP_PASSED" in result.stdout + result.stderr


def test_without_the_variables_everything_runs(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    summary = _pytest(tmp_path).stdout.strip().splitlines()[-1]
    assert "deselected" not in summary and "3 passed" in summary, summary
