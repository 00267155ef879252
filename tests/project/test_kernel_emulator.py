"""tools/gpusim/kernel_emulator.py: mpifsdp's raw CUDA kernels built by g++ and run on the CPU with CUDA's
execution model. Its own semantics (block barriers that threads returning early leave, warp
shuffles, the blocks' partials added in two levels by the last to finish, dynamic shared memory, a
barrier some threads never reach named); every kernel family's first-use checks with its source as
the kernel, in each element type (what a device runs before each kernel's first real use). The
whole GPU step with every kernel's source, `STANDIN_KERNELS=source python -m gpusim
tools/gpusim/standin_checks.py`, takes about a minute: run it by hand after changing a kernel."""

import numpy as np
import pytest
from gpusim import kernel_emulator

from mpifsdp.base import kernels as base_kernels
from mpifsdp.base.checks import bfloat16
from mpifsdp.base.kernels import comparable, typed_source
from mpifsdp.cuda import adamw as gpu_adamw
from mpifsdp.cuda import cross_entropy as gpu_cross_entropy
from mpifsdp.cuda import kernels as gpu_kernels
from mpifsdp.cuda import layer_norm as gpu_layer_norm
from mpifsdp.cuda import norm as gpu_norm
from mpifsdp.cuda import step as gpu_step

COLUMN_SUMS = r"""
extern "C" __global__ void column_sums(const ELEM* x, ACC* partial, ACC* sums, unsigned int* done,
                                       const int rows, const int C) {
    /* block b adds rows b, b + gridDim.x, ... of every column; then the blocks' partials */
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        ACC s = 0;
        for (int r = blockIdx.x; r < rows; r += gridDim.x) s += (ACC)x[(size_t)r * C + j];
        partial[(size_t)blockIdx.x * C + j] = s;
    }
    if (!column_sums_done(partial, 1, C, done)) return;
    sum_over_groups(partial, sums, C);
}
extern "C" __global__ void block_totals(const ELEM* x, ACC* totals, const int n) {
    /* one block a run of blockDim.x elements: their sum, through shuffles and shared memory */
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const ACC total = block_reduce(i < n ? (ACC)x[i] : (ACC)0, false);
    if (threadIdx.x == 0) totals[blockIdx.x] = total;
}
extern "C" __global__ void early_return(ACC* out, const int live) {
    /* threads from `live` on return at once: the barrier waits for the others only */
    extern __shared__ unsigned char shared_bytes[];
    ACC* seen = (ACC*)shared_bytes;
    if ((int)threadIdx.x >= live) return;
    seen[threadIdx.x] = (ACC)(threadIdx.x + 1);
    __syncthreads();
    out[threadIdx.x] = seen[live - 1 - threadIdx.x];
}
extern "C" __global__ void divergent_barrier(ACC* out) {
    /* half a warp at a __syncthreads, its other half at a shuffle: neither ever opens */
    if (threadIdx.x < 16) __syncthreads();
    else out[0] = __shfl_xor_sync(0xffffffff, (ACC)1, 1);
}
"""


@pytest.fixture(scope="module")
def kernels(comm):
    if comm.size > 1:
        pytest.skip("one single-process build: the plain-pytest pass covers it")
    module = kernel_emulator.RawModule(typed_source(np.float64, COLUMN_SUMS))
    names = ("column_sums", "block_totals", "early_return", "divergent_barrier")
    return {name: module.get_function(name) for name in names}


@pytest.mark.parametrize("C", [40, 41])
@pytest.mark.parametrize("blocks", [20, 70])
def test_the_blocks_partials_are_added_in_two_levels(kernels, blocks, C):
    """20 blocks: one group, more than add_rows loads ahead (16); 70: three groups, the last short;
    rows of 40 added two columns a load (16 bytes), of 41 one."""
    rows = 70
    x = np.random.default_rng(0).standard_normal((rows, C))
    partial, sums, done = np.empty((blocks, C)), np.empty(C), np.zeros(65, np.uint32)
    for _ in range(2):  # the counters are back at 0 for the next launch
        kernels["column_sums"](blocks, 64, (x, partial, sums, done, np.int32(rows), np.int32(C)))
        np.testing.assert_allclose(sums, x.sum(axis=0), rtol=1e-13, atol=1e-13)
        assert not done.any()


def test_a_block_reduction_through_shuffles_and_shared_memory(kernels):
    x = np.arange(1.0, 301.0)
    totals = np.empty(3)
    kernels["block_totals"](3, 128, (x, totals, np.int32(x.size)))
    np.testing.assert_array_equal(totals, [x[:128].sum(), x[128:256].sum(), x[256:].sum()])


def test_threads_that_return_early_leave_the_barrier(kernels):
    out = np.full(64, -1.0)
    kernels["early_return"](1, 64, (out, np.int32(24)), shared_mem=64 * 8)
    np.testing.assert_array_equal(out[:24], np.arange(24, 0, -1))
    assert (out[24:] == -1).all()


def test_a_barrier_some_threads_never_reach_is_named(kernels):
    with pytest.raises(RuntimeError, match="divergent_barrier: block .*deadlock"):
        kernels["divergent_barrier"](1, 32, (np.zeros(1),))


def test_a_source_gpp_cannot_build_is_named_and_remembered(comm):
    """mpifsdp falls back to unfused passes where a kernel does not build, so the emulator remembers
    every failed build: `python -m gpusim` then fails the run (it checked less than it claims)."""
    if comm.size > 1:
        pytest.skip("one single-process build: the plain-pytest pass covers it")
    failed = len(kernel_emulator.FAILED)
    with pytest.raises(RuntimeError, match="g\\+\\+ could not build"):
        kernel_emulator.RawModule('extern "C" __global__ void broken(float* x) { x[0] = undeclared; }')
    assert len(kernel_emulator.FAILED) == failed + 1


def _emulated(source, names: tuple, dtype) -> tuple:
    module = kernel_emulator.RawModule(source(np.dtype(dtype).type))
    return tuple(module.get_function(name) for name in names)


def _layer_norm_probe(dtype, monkeypatch):
    emulated = _emulated(gpu_layer_norm.source, gpu_layer_norm.KERNELS, dtype)
    monkeypatch.setattr(gpu_layer_norm, "_kernels", lambda *arrays, stats=(): emulated)
    return gpu_layer_norm._probe(np, dtype, backward=True)


def _cross_entropy_probe(dtype, monkeypatch):
    emulated = _emulated(gpu_cross_entropy.source, gpu_cross_entropy.KERNELS, dtype)
    monkeypatch.setattr(gpu_cross_entropy, "_kernels", lambda *a: emulated)
    return gpu_cross_entropy._probe(np, dtype, backward=True)


def _gelu_probes(dtype, monkeypatch):
    sums, rows = _emulated(gpu_kernels.gelu_sums_source, gpu_kernels.GELU_SUMS_KERNELS, dtype)
    return gpu_kernels._gelu_sums_probe(np, dtype, sums) + gpu_kernels._gelu_bias_rows_probe(np, dtype, rows)


def _softmax_probe(dtype, monkeypatch):
    return gpu_kernels._row_probe(
        np, dtype, _emulated(gpu_kernels.row_source, gpu_kernels.ROW_KERNELS, dtype)
    )


def _adamw_probes(dtype, monkeypatch):
    step, groups = _emulated(gpu_adamw.source, gpu_adamw.KERNELS, dtype)
    results = gpu_adamw._probe(np, dtype, step) + gpu_adamw._probe_groups(np, dtype, groups)
    if dtype == np.float32:  # float32 masters cast as they are updated: the four-at-a-time path's casts
        for cast in (np.dtype(np.float16), np.dtype(bfloat16())):
            casting = _emulated(lambda d, cast=cast: gpu_adamw.source(d, cast), gpu_adamw.KERNELS, dtype)[1]
            results += gpu_adamw._probe_groups(np, dtype, casting, cast)
    return results


def _norm_probe(dtype, monkeypatch):
    return gpu_norm._probe(np, dtype, _emulated(gpu_norm.source, gpu_norm.KERNELS, dtype))


def _step_probe(dtype, monkeypatch):
    return gpu_step._probe(np, dtype, _emulated(gpu_step.source, gpu_step.KERNELS, dtype))


def _flag_probes(dtype, monkeypatch):
    flag, cast = _emulated(base_kernels.flag_source, base_kernels.FLAG_KERNELS, dtype)
    return base_kernels._flag_probe(np, dtype, flag) + base_kernels._cast_flag_probe(np, dtype, cast)


PROBES = {
    "layer_norm": _layer_norm_probe,
    "cross_entropy": _cross_entropy_probe,
    "gelu": _gelu_probes,
    "causal_softmax": _softmax_probe,
    "adamw": _adamw_probes,
    "sum_of_squares": _norm_probe,
    "step_verdict": _step_probe,
    "nonfinite_flags": _flag_probes,
}


@pytest.mark.parametrize("family", sorted(PROBES))
def test_every_kernels_source_passes_its_first_use_check_in_every_dtype(comm, monkeypatch, family):
    """Each family's first-use probes (what a device runs before a kernel's first real use), with
    the kernels run as their emulated CUDA source and NumPy as the device, in float16, bfloat16,
    float32 and float64: every result within its bound of the twin's."""
    if comm.size > 1:
        pytest.skip("one single-process build: the plain-pytest pass covers it")
    for dtype in (np.dtype(np.float16), np.dtype(bfloat16()), np.dtype(np.float32), np.dtype(np.float64)):
        for what, got, want, bound in PROBES[family](dtype, monkeypatch):
            err = float(
                np.max(
                    np.abs(
                        np.asarray(comparable(got), np.float64) - np.asarray(comparable(want), np.float64)
                    ),
                    initial=0,
                )
            )
            assert err <= bound, f"{family} {dtype}: {what} off by {err:.3g}, bound {bound:.3g}"
