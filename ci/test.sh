#!/usr/bin/env bash
# The whole test suite: lint, layout, install-alone, then every package's tests.
# Sets itself up first (ci/setup.sh). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p build
# The vLLM environment is needed only by the vLLM stage: build it in the background (it is mostly
# downloads and unpacking) while the lint, install-alone and main test stages run; wait for it there.
bash ci/setup_vllm.sh > build/setup-vllm.log 2>&1 &
vllm_setup=$!
export PLAIT_VLLM_SETUP_ELSEWHERE=1
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
  # The reliability suite (fault injection, hang detection, restarts) mostly waits on timeouts and
  # restarts, and is built to pass with the machine loaded (docs/reliability.md measures it beside a
  # load generator), so it runs beside the rest instead of after it.
  reliability=(tests/test_reliability_*.py)
  echo "== tests (what did not already pass installed alone); beside them: ${reliability[*]}"
  python -m pytest -q -ra --durations=10 --basetemp=build/pytest-reliability "${reliability[@]}" \
    > build/reliability-tests.log 2>&1 &
  reliability_run=$!
  main_rc=0
  PYTHONPATH="$ROOT/ci${PYTHONPATH:+:$PYTHONPATH}" PLAIT_SKIP_PASSED="${PLAIT_ISOLATION_DIR:-$ROOT/build/install-alone}/passed" \
    python -m pytest -q -ra --durations=15 -p passed_alone "${reliability[@]/#/--ignore=}" || main_rc=$?
  reliability_rc=0
  wait "$reliability_run" || reliability_rc=$?
  echo "== reliability suite (ran beside the tests above)"; cat build/reliability-tests.log
  [ "$main_rc" -eq 0 ] && [ "$reliability_rc" -eq 0 ] || { echo "test.sh: tests failed"; exit 1; }
else
  echo "== tests"; python -m pytest -q -ra --durations=15 "$@"
fi
# plait-vllm's tests, and the training-to-vLLM test, inside the vLLM environment (.venv-vllm, built by
# ci/setup_vllm.sh); in .venv they skip.
vllm_setup_rc=0
wait "$vllm_setup" || vllm_setup_rc=$?
if [ "$vllm_setup_rc" -ne 0 ]; then cat build/setup-vllm.log; echo "test.sh: the vLLM environment did not build"; exit 1; fi
if [ "$#" -eq 0 ]; then
  if [ -x .venv-vllm/bin/python ]; then
    echo "== vllm tests (.venv-vllm)"; .venv-vllm/bin/python -m pytest -q -ra --durations=5 integrations/vllm/tests tests/test_vllm_serving.py
  else
    echo "== vllm tests: NOT RUN (no .venv-vllm; PLAIT_VLLM_ENV=0 was set for setup)"
  fi
fi
# The main job itself, end to end, as the README's first command runs it.
if [ "$#" -eq 0 ]; then echo "== main job"; plait train --out build/main-job-ci; fi
echo "test.sh: finished in $(( $(date +%s) - start ))s after setup"
