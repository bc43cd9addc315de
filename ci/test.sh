#!/usr/bin/env bash
# The whole test suite: lint, layout, install-alone, then every package's tests.
# Sets itself up first (ci/setup.sh). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
. ci/setup.sh
start=$(date +%s)
echo "== ruff"; ruff check .
echo "== layout"; python ci/check_layout.py
echo "== install alone"; python ci/check_install_alone.py
# With no arguments, the tests that already passed where their distribution was installed alone are
# not run again here (ci/passed_alone.py): what runs is the cross-package suite and whatever needed
# an extra the lone install lacked. With arguments, exactly what was asked runs.
if [ "$#" -eq 0 ]; then
  echo "== tests (what did not already pass installed alone)"
  PYTHONPATH="$ROOT/ci${PYTHONPATH:+:$PYTHONPATH}" PLAIT_SKIP_PASSED="${PLAIT_ISOLATION_DIR:-$ROOT/build/install-alone}/passed" \
    python -m pytest -q -ra --durations=15 -p passed_alone
else
  echo "== tests"; python -m pytest -q -ra --durations=15 "$@"
fi
# plait-vllm's tests, and the training-to-vLLM test, inside the vLLM environment (.venv-vllm, built by
# ci/setup_vllm.sh); in .venv they skip.
if [ "$#" -eq 0 ]; then
  if [ -x .venv-vllm/bin/python ]; then
    echo "== vllm tests (.venv-vllm)"; .venv-vllm/bin/python -m pytest -q -ra --durations=5 integrations/vllm/tests tests/test_vllm_serving.py
  else
    echo "== vllm tests: NOT RUN (no .venv-vllm; PLAIT_VLLM_ENV=0 was set for setup)"
  fi
fi
# The main job itself, end to end, as the README's first command runs it (issue: run it in CI).
if [ "$#" -eq 0 ]; then echo "== main job"; plait train --out build/main-job-ci; fi
echo "test.sh: finished in $(( $(date +%s) - start ))s after setup"
