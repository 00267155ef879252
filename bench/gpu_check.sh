#!/usr/bin/env bash
# make gpu-check: every GPU check in one command (at most 8 minutes on one H200), logs under ${OUT:-out/gpu}.
# Every step runs even when an earlier one failed; the exit status is non-zero if any step failed
# (a failing test, a parity error beyond its bound, a crash or a timeout). The steps share one time
# budget (GPU_CHECK_BUDGET seconds), so the whole check ends inside it even when a step hangs.
# GPU_CHECK_DEVICE=cpu runs the same script without a GPU (a dry run: the CuPy tests then fail);
# GPU_CHECK_ONLY=REGEX only the steps whose command matches it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-out/gpu}")
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
PY=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET:-480}
END=$((SECONDS + BUDGET))
# The lent device reaches no registry: the wheels `make gpu-wheels` put in .whl (an MPI with its mpiexec,
# mpi4py for it, cuDNN's frontend, pytest-mpi) are installed under a prefix of their own first
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if [ "$DEVICE" != cpu ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --ignore-installed --no-index --no-deps --no-compile --no-cache-dir --prefix "$SITE" \
    "$WHEELS"/*.whl || { echo "gpu-check: the wheels in $WHEELS did not install" | tee -a "$LOG"; exit 1; }
  found() { dirname "$(find "$SITE" -name "$1" | head -1)"; }  # the prefix's layout is the Python's own
  export PYTHONPATH="$(found '*.dist-info')${PYTHONPATH:+:$PYTHONPATH}" PATH="$(found mpiexec):$PATH"
  export LD_LIBRARY_PATH="$(found 'libmpi.so*')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # for mpi4py
fi
export MPIFSDP_REQUIRE_GPU=$([ "$DEVICE" = cpu ] && echo 0 || echo 1)  # no GPU: fail, never skip
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# Run this checkout, installed or not (the package is mpifsdp/ whole, its models too): `python -c`
# would find it from here anyway, but `python -m mpi4py bench/x.py` puts bench/ first on its path;
# tools/ holds gpusim, which the suite's GPU tests import (make install puts it in the venv here).
export PYTHONPATH="$PWD:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
FAILED=()
run() {  # run LIMIT_SECONDS COMMAND...: at most LIMIT, and never past the budget's end
  local limit=$1; shift
  # GPU_CHECK_ONLY=REGEX runs only the steps whose command matches (a rerun of what failed)
  if [ -n "${GPU_CHECK_ONLY:-}" ] && ! [[ "$*" =~ $GPU_CHECK_ONLY ]]; then return; fi
  local left=$((END - SECONDS))
  if [ "$left" -lt 10 ]; then FAILED+=("$* (not run: budget spent)"); return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== [${SECONDS}s] $*" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then FAILED+=("$* (exit $rc)"); fi
}
CHECK="$PY bench/gpu_check.py"
MPICHECK="$MPIEXEC -n"
# the dry run has no transport to choose and a smaller model to time
if [ "$DEVICE" = cpu ]; then HOST=(); SPEED=(--config tiny --steps 1); else HOST=(--transport host); SPEED=(--config peer --steps 5); fi
# Ordered by what each step teaches, the budget cutting the last ones first:
# 1. the environment: the GPU, CuPy, CUDA, cuDNN, the MPI and every libnccl on the machine (preflight)
[ "$DEVICE" != cpu ] && run 20 nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total,driver_version --format=csv
run 60 $CHECK preflight --device "$DEVICE"
# 2. the ~370M model at this commit in float16 from one CUDA graph of its passes, then of the whole
#    step (the optimizer's in it too: one host sync a step) (tokens/s, TFLOP/s, MFU in both
#    conventions, the pool against the plan, each kernel's time by CUPTI; every fused kernel's
#    first-use check runs here)
[ "$DEVICE" != cpu ] && run 100 $CHECK speed --config gpu350m --dtype float16 --steps 3 --profile --graph --transport nccl --kernels
# 3. the micro-benchmarks the step stands on, calls queued between two syncs: each GEMM of the step
#    and its variants, the copy bandwidth, cuDNN's attention against the batched passes
if [ "$DEVICE" != cpu ]; then
  run 45 $CHECK roofline --config gpu350m
  run 60 $CHECK attention --config gpu350m
fi
# 4. a model that needs sharding: rank 0 of an 8-way ~13B job alone (PhantomComm: N's shards, gathers
#    and reduce-scatters on the collective stream), bfloat16, blocks recomputed where the plan says
#    they would not fit otherwise (at batch 4 they fit: 76,000 MiB planned), from one CUDA graph
#    (the passes', then the whole step's); its pool against the plan
if [ "$DEVICE" != cpu ]; then
  run 230 $CHECK speed --config gpu13b --dtype bfloat16 --phantom 8 --recompute auto --steps 2 --graph
else
  run 60 $CHECK speed --device cpu --config tiny --phantom 8 --recompute yes --steps 1
fi
# 5. multi-rank truth on one GPU: one process against the CPU, 2 and 4 ranks and HSDP 2 x 2 over host
#    staging, one rank's own NCCL collectives eager and replayed, and 2 ranks over NCCL where its
#    version lets ranks share the GPU (2.30 and later), eager and replayed
run 45 $CHECK parity --device "$DEVICE"
run 60 $MPICHECK 2 $PY -m mpi4py bench/gpu_check.py parity --device "$DEVICE" --sharded "${HOST[@]}"
run 60 $MPICHECK 4 $PY -m mpi4py bench/gpu_check.py parity --device "$DEVICE" --sharded "${HOST[@]}"
run 60 $MPICHECK 4 $PY -m mpi4py bench/gpu_check.py parity --device "$DEVICE" --sharded --shard-size 2 "${HOST[@]}"
if [ "$DEVICE" != cpu ]; then
  run 45 $MPICHECK 1 $PY -m mpi4py bench/gpu_check.py parity --sharded --transport nccl
  run 45 env MPIFSDP_ONE_RANK_SHORTCUTS=0 $CHECK replay --transport nccl
  if grep -q '"nccl_multi_rank_gpu": true' "$LOG"; then
    export NCCL_MULTI_RANK_GPU_ENABLE=1
    run 60 $MPICHECK 2 $PY -m mpi4py bench/gpu_check.py parity --sharded --transport nccl
    run 60 $MPICHECK 2 $PY -m mpi4py bench/gpu_check.py replay --transport nccl
    unset NCCL_MULTI_RANK_GPU_ENABLE
  fi
fi
# 6. every test parametrized by device (each primitive's forward and VJP, layers, GPT) on CuPy
run 100 $PY -m pytest -q -p no:cacheprovider -k cuda tests/
# 7. what a lent device has taught before: bfloat16 eager and replayed, the column-sum kernels by
#    thread blocks, CUDA-aware MPI, two ranks' overlap over host staging
if [ "$DEVICE" != cpu ]; then
  run 120 $CHECK speed --config gpu350m --dtype bfloat16 --steps 3 --graph --transport nccl
  run 45 $CHECK columns --config gpu350m
  # CUDA-aware MPI: must pass where the library says it is CUDA-aware; where it says it is not,
  # mpifsdp stages through the host instead (the host parity above); where it cannot say, a probe
  # whose failure is reported, not counted (an MPI that is not CUDA-aware may crash on device pointers)
  if grep -q '"mpi_cuda_aware": true' "$LOG"; then
    run 60 $MPICHECK 2 $PY -m mpi4py bench/gpu_check.py parity --sharded --transport cuda-aware-mpi
  elif grep -q '"mpi_cuda_aware": null' "$LOG" && [ -z "${GPU_CHECK_ONLY:-}" ]; then
    echo "== [${SECONDS}s] probe: this MPI does not say it is CUDA-aware; trying device pointers anyway" | tee -a "$LOG"
    timeout -k 5 30 $MPICHECK 2 $PY -m mpi4py bench/gpu_check.py parity --sharded --transport cuda-aware-mpi \
      2>&1 | tail -5 | tee -a "$LOG"
    echo "== probe exit ${PIPESTATUS[0]} (not counted)" | tee -a "$LOG"
  fi
fi
# speed and overlap: two ranks on one GPU over host staging, gathers ahead (prefetch 1) or not (0)
for p in 1 0; do
  run 45 $MPICHECK 2 $PY -m mpi4py bench/gpu_check.py speed --device "$DEVICE" "${HOST[@]}" "${SPEED[@]}" --prefetch $p
done
run 45 $CHECK speed --device "$DEVICE" "${SPEED[@]}"
run 45 $CHECK speed --device "$DEVICE" "${SPEED[@]}" --dtype float16
if [ ${#FAILED[@]} -ne 0 ]; then
  printf 'gpu-check FAILED:\n' | tee -a "$LOG"
  printf '  %s\n' "${FAILED[@]}" | tee -a "$LOG"
  exit 1
fi
echo "gpu-check passed in ${SECONDS}s" | tee -a "$LOG"
