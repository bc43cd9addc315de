#!/usr/bin/env bash
# The project's main job on its built-in default data. Sets itself up first (ci/setup.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The main job never uses vLLM: build .venv alone (ci/test.sh builds .venv-vllm for plait-vllm's tests).
export PLAIT_VLLM_ENV="${PLAIT_VLLM_ENV:-0}"
# shellcheck disable=SC1091
. ci/setup.sh
plait report
plait train
