#!/usr/bin/env bash
# make gpu-check: every GPU check in one command (<= 8 minutes on one H200), logs under ${OUT:-out/gpu}.
# Every step runs even when an earlier one failed; the exit status is non-zero if any step failed
# (a failing test, a parity error beyond its bound, a crash or a timeout).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
FAILED=()
run() {
  echo "== $*" | tee -a "$OUT/gpu-check.log"
  timeout 300 "$@" 2>&1 | tee -a "$OUT/gpu-check.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then FAILED+=("$* (exit $rc)"); fi
}
run $PY -m pytest -q tests/test_ops.py tests/test_layers.py tests/test_gpt.py     # backend-parametrized: cupy too
run $PY bench/gpu_check.py parity
run $MPIEXEC -n 2 $PY -m mpi4py bench/gpu_check.py parity --sharded --transport host  # 2 ranks, one GPU
run $MPIEXEC -n 1 $PY -m mpi4py bench/gpu_check.py parity --sharded --transport nccl
run $PY bench/gpu_check.py speed --config peer
run $PY bench/gpu_check.py speed --config gpu350m --dtype float16 --steps 3
if [ ${#FAILED[@]} -ne 0 ]; then
  printf 'gpu-check FAILED:\n' | tee -a "$OUT/gpu-check.log"
  printf '  %s\n' "${FAILED[@]}" | tee -a "$OUT/gpu-check.log"
  exit 1
fi
echo "gpu-check passed" | tee -a "$OUT/gpu-check.log"
