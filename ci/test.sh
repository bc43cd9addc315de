#!/usr/bin/env bash
# The whole test suite: lint, layout, install-alone, then every package's tests.
# Sets itself up first (ci/setup.sh). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p build
rm -rf build/junit  # every pytest run below writes its JUnit XML here; ci/slowest.py reads them at the end
# The whole run: the vLLM environment is needed only by the vLLM tests, so it is built in the
# background (mostly downloads and unpacking) while the lint, install-alone and main test stages
# run; its exit status lands in build/setup-vllm.rc. With arguments, ci/setup.sh builds it as usual.
if [ "$#" -eq 0 ]; then
  rm -f build/setup-vllm.rc
  ( rc=0; bash ci/setup_vllm.sh > build/setup-vllm.log 2>&1 || rc=$?
    echo "$rc" > build/setup-vllm.rc.tmp && mv build/setup-vllm.rc.tmp build/setup-vllm.rc ) &
  export PLAIT_VLLM_SETUP_ELSEWHERE=1
fi
# The documentation site's tools and Chromium (ci/setup.sh installs them when asked).
export PLAIT_DOCS="${PLAIT_DOCS:-1}"
# shellcheck disable=SC1091
. ci/setup.sh
start=$(date +%s)
# How busy the cores are in each stage (ci/cpu_busy.py): the table at the end says which stages
# mostly wait and could share the two cores with another.
busy() { python ci/cpu_busy.py mark "$1"; }
python ci/cpu_busy.py reset
# Whatever happens (a failed stage exits at once under set -e), a whole run ends with the slowest
# tests of every pytest run so far (ci/slowest.py) and the cores busy per stage.
whole_run=$(( $# == 0 ))
finish() {
  local rc=$?
  if [ "$whole_run" = 1 ]; then
    python ci/slowest.py build/junit 30 || true
    busy "end" || true
    python ci/cpu_busy.py report || true
  fi
  echo "test.sh: finished in $(( $(date +%s) - start ))s after setup"
  exit "$rc"
}
trap finish EXIT
busy "ruff"; echo "== ruff"; ruff check .
busy "layout"; echo "== layout"; python ci/check_layout.py
# The documentation site: results pages current, mkdocs build --strict, every internal link, and
# the home page, a guide and a results page opened in headless Chromium (screenshots in build/site-shots/).
if [ "$PLAIT_DOCS" = "1" ]; then busy "docs site"; echo "== docs site"; python ci/build_docs.py; fi
busy "install alone"; echo "== install alone"; python ci/check_install_alone.py
# With no arguments, the tests that already passed where their distribution was installed alone are
# not run again here (ci/passed_alone.py): what runs is the cross-package suite and whatever needed
# an extra the lone install lacked. With arguments, exactly what was asked runs.
if [ "$#" -eq 0 ]; then
  # A second lane beside the main test run: the reliability suite (fault injection, hang detection,
  # restarts: it mostly waits on timeouts and restarts, and docs/reliability.md measures it passing
  # beside a load generator), then plait-vllm's tests and the training-to-vLLM test inside the vLLM
  # environment (.venv-vllm, built in the background above; in .venv they skip), then the guides'
  # examples (tests/test_docs_guides.py; the vLLM guide runs in .venv-vllm), then its share of the
  # long cross-package files below (`shared`), then the main job end to end, as the README's first
  # command runs it. The reliability suite does not run beside install-alone: it slowed that
  # stage's tests by 1.8x (both cores are busy).
  # `shared`: each lane, once its own part is done, takes the next of these groups of long files
  # that the other lane has not taken (longest first), so the two lanes end about together whatever
  # their own parts cost on the day; a fixed split went stale whenever one lane's tests got cheaper.
  # A group is one pytest run (one test process server to start: 6.4 CPU-s of imports), hence groups.
  reliability=(tests/test_reliability_*.py)
  guides=(tests/test_docs_guides.py)
  shared=("tests/test_onebit_quality.py tests/test_offload_capacity.py tests/test_zeropp_two_nodes.py"
          "tests/test_onebit_zero_lamb.py tests/test_onebit_zero.py"
          "tests/test_onebit_zero_one.py tests/test_onebit_zero_clip_fp16.py")
  read -r -a shared_files <<< "${shared[*]}"
  rm -rf build/claimed && mkdir -p build/claimed
  run_shared() {  # $1: the lane; runs each shared group that no lane has taken yet
    local rc=0 group name files
    for group in "${shared[@]}"; do
      read -r -a files <<< "$group"
      name=$(basename "${files[0]}" .py)
      mkdir "build/claimed/$name" 2>/dev/null || continue  # mkdir is atomic: exactly one lane takes it
      busy "two lanes ($1: $name and the rest of its group)"; echo "== $group (in the $1 lane)"
      python -m pytest -q -ra --durations=5 --junitxml="build/junit/shared-$name.xml" --basetemp="build/pytest-shared-$1" \
        "${files[@]}" || rc=1
    done
    return "$rc"
  }
  echo "== tests (what did not already pass installed alone); beside them: ${reliability[*]}, then the vLLM tests, then ${guides[*]}"
  second_lane() {
    busy "two lanes (second: reliability)"
    python -m pytest -q -ra --durations=10 --junitxml=build/junit/reliability.xml --basetemp=build/pytest-reliability \
      "${reliability[@]}" || return 1
    while [ ! -f build/setup-vllm.rc ]; do sleep 5; done
    [ "$(cat build/setup-vllm.rc)" = 0 ] || { cat build/setup-vllm.log; echo "the vLLM environment did not build"; return 1; }
    if [ -x .venv-vllm/bin/python ]; then
      busy "two lanes (second: vllm)"
      .venv-vllm/bin/python -m pytest -q -ra --durations=5 --junitxml=build/junit/vllm.xml --basetemp=build/pytest-vllm \
        integrations/vllm/tests tests/test_vllm_serving.py tests/test_docs_guide_vllm.py || return 1
    else
      echo "vllm tests: NOT RUN (no .venv-vllm; PLAIT_VLLM_ENV=0 was set for setup)"
    fi
    busy "two lanes (second: guides)"
    python -m pytest -q -ra --durations=5 --junitxml=build/junit/guides.xml --basetemp=build/pytest-guides "${guides[@]}" || return 1
    run_shared second || return 1
    busy "two lanes (second: main job)"
    echo "== main job"; plait train --out build/main-job-ci
    busy "second lane finished"
  }
  second_lane > build/second-lane.log 2>&1 &
  lane=$!
  main_rc=0
  PYTHONPATH="$ROOT/ci${PYTHONPATH:+:$PYTHONPATH}" PLAIT_SKIP_PASSED="${PLAIT_ISOLATION_DIR:-$ROOT/build/install-alone}/passed" \
    python -m pytest -q -ra --durations=40 --junitxml=build/junit/main.xml -p passed_alone \
    "${reliability[@]/#/--ignore=}" "${guides[@]/#/--ignore=}" "${shared_files[@]/#/--ignore=}" --ignore=tests/test_vllm_serving.py --ignore=tests/test_docs_guide_vllm.py || main_rc=$?
  run_shared main || main_rc=1
  busy "main lane finished"
  lane_rc=0
  wait "$lane" || lane_rc=$?
  echo "== reliability suite, then vllm tests (.venv-vllm), the guides, the shared groups it took and the main job: ran beside the tests above"; cat build/second-lane.log
  [ "$main_rc" -eq 0 ] && [ "$lane_rc" -eq 0 ] || { echo "test.sh: tests failed"; exit 1; }
else
  echo "== tests"; python -m pytest -q -ra --durations=15 "$@"
fi
