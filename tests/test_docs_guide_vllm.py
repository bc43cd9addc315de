"""The vLLM guide (``docs/guides/vllm.md``) runs as written: its example trains a tiny Llama, saves a
universal checkpoint and serves it through vLLM with ``load_format="plait_universal"``, and the
served tokens are the toy language's. Needs vLLM: CI runs it in the vLLM environment
(``.venv-vllm``); elsewhere it skips. The other guides are run by ``test_docs_guides.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docs_guides import GUIDES, examples, run_example

TIMEOUT_S = 300   # one bash block; generous, for a loaded machine


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_vllm_guide_example_runs_as_written(tmp_path: Path) -> None:
    found = [e for e in examples(GUIDES / "vllm.md") if e.runs]
    assert found, "the vLLM guide has no example that a test runs"
    for example in found:
        run_example(example, tmp_path, TIMEOUT_S)
