"""cuBLAS's gemmEx as cuda/gemm.py calls it (16-bit operands into a float32 product, any float
type into its own, written or added to out) on host memory, through tools/gpusim/cupy_standin.py's
column-major gemmEx: the operand layouts and leading dimensions it hands cuBLAS give the product,
and its check at first use names a GEMM that computes it wrong."""

import functools
import types

import ml_dtypes
import numpy as np
import pytest
from gpusim import cupy_standin

from mpifsdp.base import kernels
from mpifsdp.cuda import cublas_api
from mpifsdp.cuda import gemm as gpu_gemm


@pytest.fixture
def cublas(monkeypatch):
    """cuBLAS's C API as the stand-in's, on host memory (one stream, workspaces in host memory); each
    test's GEMMs checked afresh."""
    library = cupy_standin.cublas_library()
    host = types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=1)), empty=np.empty
    )
    monkeypatch.setattr(cublas_api, "_handle", functools.cache(lambda: cublas_api._Handle(library, host)))
    for key in [k for k in kernels._checked if k[0] == "gemm_into"]:
        kernels._checked.discard(key)
    return library


def _bound(a, b, out):
    """K + 1 roundings in the arithmetic's type of sums of |a||b| (+ |out|) terms, and one to out's
    type (the probe's bound, derived the same way)."""
    a64, b64, c64 = (np.asarray(m, np.float64) for m in (a, b, out))
    scale = float(np.max(np.abs(a64) @ np.abs(b64) + np.abs(c64)))
    return kernels.error_bound(out.dtype.type, a.shape[1] + 1, scale)


def _layouts(m):
    """m as a C-contiguous array, a transposed view, and rows of a wider array (a leading dimension
    larger than its row)."""
    wide = np.zeros((m.shape[0], m.shape[1] + 3), m.dtype)
    wide[:, : m.shape[1]] = m
    return {"rows": m, "transposed view": np.ascontiguousarray(m.T).T, "strided rows": wide[:, : m.shape[1]]}


TYPES = [
    (np.float16, np.float32),
    (ml_dtypes.bfloat16, np.float32),
    (np.float16, np.float16),
    (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
    (np.float32, np.float32),
    (np.float64, np.float64),
]


@pytest.mark.parametrize("accumulate", [False, True], ids=["written", "accumulated"])
@pytest.mark.parametrize(
    "dtype, out_dtype", TYPES, ids=[f"{np.dtype(a).name}->{np.dtype(o).name}" for a, o in TYPES]
)
def test_the_gemm_writes_the_product_in_every_operand_layout(cublas, dtype, out_dtype, accumulate):
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, (9, 13)).astype(dtype), rng.normal(0, 1, (13, 6)).astype(dtype)
    before = rng.normal(0, 1, (9, 6)).astype(out_dtype)
    want = a.astype(np.float64) @ b.astype(np.float64) + (before.astype(np.float64) if accumulate else 0)
    for a_name, left in _layouts(a).items():
        for b_name, right in _layouts(b).items():
            out = before.copy()
            gpu_gemm.gemm_into(left, right, out, accumulate=accumulate)
            err = float(np.max(np.abs(out.astype(np.float64) - want)))
            assert err <= _bound(a, b, before), (a_name, b_name, err)
    assert ("gemm_into", dtype, out_dtype) in kernels._checked  # its first use checked it


def test_a_gemm_that_computes_wrong_is_named_at_first_use(cublas, monkeypatch):
    """A cuBLAS call that leaves out the last term of every sum (an off-by-one in K) is caught by the
    probe before any result is used."""
    right = cublas.cublasGemmEx

    def one_term_short(handle, transa, transb, m, n, k, *rest):
        return right(handle, transa, transb, m, n, k - 1, *rest)

    monkeypatch.setattr(cublas, "cublasGemmEx", one_term_short)
    a, b = np.ones((4, 3), np.float16), np.ones((3, 2), np.float16)
    with pytest.raises(RuntimeError, match=r"gemm_into \(float16\) computes .* wrong"):
        gpu_gemm.gemm_into(a, b, np.empty((4, 2), np.float32))
    assert ("gemm_into", np.float16, np.float32) not in kernels._checked


@pytest.mark.parametrize(
    "a, b, out, error",
    [
        (np.ones((4, 3), np.float16), np.ones((2, 2), np.float16), np.empty((4, 2), np.float32), ValueError),
        (
            np.ones((4, 3), np.float16),
            np.ones((3, 2), np.float16),
            np.empty((2, 4), np.float32).T,
            ValueError,
        ),
        (np.ones((4, 3), np.float32), np.ones((3, 2), np.float32), np.empty((4, 2), np.float64), TypeError),
        (np.ones((4, 3), np.float16), np.ones((3, 2), np.float16), np.empty((4, 2), np.float64), TypeError),
        (np.ones((4, 3), np.float16), np.ones((3, 2), np.float32), np.empty((4, 2), np.float32), TypeError),
        (np.ones((4, 3), np.int32), np.ones((3, 2), np.int32), np.empty((4, 2), np.int32), TypeError),
    ],
    ids=["shapes", "out not C-contiguous", "float32 widened", "float16 into float64", "mixed", "integers"],
)
def test_the_gemm_refuses_what_it_cannot_write(cublas, a, b, out, error):
    with pytest.raises(error, match="gemm_into"):
        gpu_gemm.gemm_into(a, b, out)


def test_a_gemm_that_ignores_what_out_held_is_named_at_first_use(cublas, monkeypatch):
    """A cuBLAS call that writes the product over out where it should add to it (beta taken as 0:
    a projection would lose its residual and bias, cuda/fused.py Seed) is caught by the probe."""
    right = cublas.cublasGemmEx

    def beta_zero(*args):
        args = list(args)
        args[13] = gpu_gemm._compute(np.float32)[2].ctypes.data  # the host zero
        return right(*args)

    monkeypatch.setattr(cublas, "cublasGemmEx", beta_zero)
    a, b = np.ones((4, 3), np.float16), np.ones((3, 2), np.float16)
    with pytest.raises(RuntimeError, match=r"gemm_into \(float16\) computes a @ b \+ out wrong"):
        gpu_gemm.gemm_into(a, b, np.empty((4, 2), np.float32), accumulate=True)


def test_every_stream_runs_cublas_on_a_workspace_of_ours(monkeypatch):
    """cublasSetStream puts a handle back on cuBLAS's own workspaces, which it allocates at a stream's
    first GEMM: refused while the stream captures a CUDA graph. So the handle sets its workspace for
    a stream after every change of stream, each stream keeping its own, and nothing when the stream
    stays the same."""
    library, calls, stream = cupy_standin.cublas_library(), [], [1]
    for name in ("cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"):
        monkeypatch.setattr(library, name, _logged(getattr(library, name), name, calls))
    host = types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=stream[0])),
        empty=np.empty,
    )
    monkeypatch.setattr(cublas_api, "_handle", functools.cache(lambda: cublas_api._Handle(library, host)))
    a, b = np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)
    for stream[0] in (1, 1, 2, 1):
        gpu_gemm._launch(a, b, np.empty((4, 2), np.float32))
    workspaces = [args[1].value for name, args in calls if name == "cublasSetWorkspace_v2"]
    streams = [args[1].value for name, args in calls if name == "cublasSetStream_v2"]
    bind, gemm = ["cublasSetStream_v2", "cublasSetWorkspace_v2"], ["cublasGemmEx"]
    assert [name for name, _ in calls] == bind + gemm + gemm + bind + gemm + bind + gemm
    assert streams == [1, 2, 1] and workspaces[0] == workspaces[2] != workspaces[1]


def _logged(call, name, calls):
    def logged(*args):
        calls.append((name, args))
        return call(*args)

    return logged
