"""The widening GEMM (ops/gpu_gemm.py: 16-bit operands, a float32 product written by cuBLAS's
gemmEx) on host memory, through bench/cupy_standin.py's column-major gemmEx: the operand layouts
and leading dimensions it hands cuBLAS give the product, and its check at first use names a GEMM
that computes it wrong."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mpifsdp.base import backend, kernels
from mpifsdp.ops import gpu_gemm

sys.path.insert(0, str(Path(__file__).parents[3] / "bench"))
import cupy_standin  # noqa: E402

MODULES = cupy_standin._cublas_modules()


@pytest.fixture
def cublas(monkeypatch):
    """cuBLAS's bindings as the stand-in's, on host memory; each test's GEMMs checked afresh."""
    cublas, runtime = MODULES["cupy_backends.cuda.libs.cublas"], MODULES["cupy_backends.cuda.api.runtime"]
    monkeypatch.setattr(backend, "cublas", lambda: (cublas, runtime, 0))
    for dtype in (np.float16, ml_dtypes.bfloat16):
        kernels._checked.discard(("gemm_into", dtype))
    return cublas


def _bound(a, b):
    """K roundings in float32 of sums of |a||b| terms (the probe's bound, derived the same way)."""
    a64, b64 = (np.asarray(m, np.float64) for m in (a, b))
    return kernels.error_bound(np.float32, a.shape[1], float(np.max(np.abs(a64) @ np.abs(b64))))


def _layouts(m):
    """m as a C-contiguous array, a transposed view, and rows of a wider array (a leading dimension
    larger than its row)."""
    wide = np.zeros((m.shape[0], m.shape[1] + 3), m.dtype)
    wide[:, : m.shape[1]] = m
    return {"rows": m, "transposed view": np.ascontiguousarray(m.T).T, "strided rows": wide[:, : m.shape[1]]}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_the_widening_gemm_writes_the_float32_product_in_every_operand_layout(cublas, dtype):
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, (9, 13)).astype(dtype), rng.normal(0, 1, (13, 6)).astype(dtype)
    want = a.astype(np.float64) @ b.astype(np.float64)
    for a_name, left in _layouts(a).items():
        for b_name, right in _layouts(b).items():
            out = np.full((9, 6), np.nan, np.float32)
            gpu_gemm.gemm_into(left, right, out)
            err = float(np.max(np.abs(out - want)))
            assert err <= _bound(a, b), (a_name, b_name, err)
    assert ("gemm_into", dtype) in kernels._checked  # its first use checked it


def test_a_gemm_that_computes_wrong_is_named_at_first_use(cublas, monkeypatch):
    """A cuBLAS call that leaves out the last term of every sum (an off-by-one in K) is caught by the
    probe before any result is used."""
    right = cublas.gemmEx

    def one_term_short(handle, transa, transb, m, n, k, *rest):
        return right(handle, transa, transb, m, n, k - 1, *rest)

    monkeypatch.setattr(cublas, "gemmEx", one_term_short)
    a, b = np.ones((4, 3), np.float16), np.ones((3, 2), np.float16)
    with pytest.raises(RuntimeError, match=r"gemm_into \(float16\) computes .* wrong"):
        gpu_gemm.gemm_into(a, b, np.empty((4, 2), np.float32))
    assert ("gemm_into", np.float16) not in kernels._checked


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
        (np.ones((4, 3), np.float32), np.ones((3, 2), np.float32), np.empty((4, 2), np.float32), TypeError),
        (np.ones((4, 3), np.float16), np.ones((3, 2), np.float16), np.empty((4, 2), np.float64), TypeError),
    ],
    ids=["shapes", "out not C-contiguous", "not 16-bit", "out not float32"],
)
def test_the_widening_gemm_refuses_what_it_cannot_write(cublas, a, b, out, error):
    with pytest.raises(error, match="gemm_into"):
        gpu_gemm.gemm_into(a, b, out)
