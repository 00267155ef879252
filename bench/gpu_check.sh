#!/usr/bin/env bash
# make gpu-check: every GPU check in one command (<= 8 minutes on one H200), logs under ${OUT:-out/gpu}.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
run() { echo "== $*" | tee -a "$OUT/gpu-check.log"; timeout 300 "$@" 2>&1 | tee -a "$OUT/gpu-check.log"; }
run $PY -m pytest -q -x tests/test_ops.py tests/test_layers.py tests/test_gpt.py     # backend-parametrized: cupy too
run $PY bench/gpu_check.py parity
run $MPIEXEC -n 2 $PY -m mpi4py bench/gpu_check.py parity --sharded               # host staging on one GPU
run $PY bench/gpu_check.py speed --config peer
run $PY bench/gpu_check.py speed --config gpu350m --dtype float16 --steps 3
