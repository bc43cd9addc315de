#!/usr/bin/env bash
# The project's main job on its built-in default data. Sets itself up first (ci/setup.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
. ci/setup.sh
plait report
plait train
