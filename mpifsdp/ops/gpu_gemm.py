"""A GEMM whose output is wider than its operands (float16 or bfloat16 in, float32 out) through
cuBLAS's gemmEx, which CuPy exposes but its matmul does not use that way: given a float32 `out`
for float16 operands, CuPy multiplies into a float16 temporary and casts it over (a launch more and
a rounding to float16 on the way). A weight gradient written straight into the float32 gradient
buffer then needs neither (issue 30: the unit's gradient is gathered in float32 on a GPU, no cast
before its reduce-scatter).

The product accumulates in float32 (CUBLAS_COMPUTE_32F), as CuPy's own float16 GEMMs do, and is
checked once per dtype against a float64 product on the host before its first result is used.
CuPy's cuBLAS bindings come through base/backend.py (cublas()); bench/cupy_standin.py provides
them, on host memory, on a machine without a GPU.
"""

from __future__ import annotations

import functools

import numpy as np

from ..base import backend
from ..base.backend import array_module_of, to_numpy
from ..base.kernels import accumulator, checked_once, device_address, error_bound


@functools.cache
def widening(operands_dtype, out_dtype) -> bool:
    """Whether gemm_into is what writes a product of `operands_dtype` into `out_dtype`: a 16-bit
    float into its float32 accumulator (equal types are CuPy's matmul)."""
    return np.dtype(operands_dtype).itemsize == 2 and np.dtype(out_dtype) == np.dtype(
        accumulator(operands_dtype)
    )


def _operand(cublas, a, itemsize: int):
    """(a, cuBLAS op, leading dimension) for a 2-D operand read column-major as its transpose: a row-
    major a (unit column stride) as it is, a column-major one (a transposed view) transposed; any
    other layout copied first."""
    if a.strides[1] == itemsize and a.strides[0] >= a.shape[1] * itemsize:
        return a, cublas.CUBLAS_OP_N, a.strides[0] // itemsize
    if a.strides[0] == itemsize and a.strides[1] >= a.shape[0] * itemsize:
        return a, cublas.CUBLAS_OP_T, a.strides[1] // itemsize
    a = array_module_of(a).ascontiguousarray(a)
    return a, cublas.CUBLAS_OP_N, a.shape[1]


@functools.cache
def _cuda_type(runtime, dtype) -> int:
    name = np.dtype(dtype).name
    return {"float16": runtime.CUDA_R_16F, "bfloat16": runtime.CUDA_R_16BF, "float32": runtime.CUDA_R_32F}[
        name
    ]


_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # gemmEx's alpha and beta, on the host


def _launch(a, b, out):
    """out (M, N), C-contiguous = a (M, K) @ b (K, N). cuBLAS is column-major: it computes out's
    transpose (N, M) = b^T a^T, each operand read as the transpose of its row-major self."""
    cublas, runtime, handle = backend.cublas()
    itemsize = a.dtype.itemsize
    (M, K), N = a.shape, b.shape[1]
    b, op_b, ld_b = _operand(cublas, b, itemsize)
    a, op_a, ld_a = _operand(cublas, a, itemsize)
    cublas.gemmEx(
        handle,
        op_b,
        op_a,
        N,
        M,
        K,
        _ONE.ctypes.data,
        device_address(b),
        _cuda_type(runtime, b.dtype),
        ld_b,
        device_address(a),
        _cuda_type(runtime, a.dtype),
        ld_a,
        _ZERO.ctypes.data,
        device_address(out),
        _cuda_type(runtime, out.dtype),
        N,
        cublas.CUBLAS_COMPUTE_32F,
        cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP,
    )


def gemm_into(a, b, out) -> None:
    """out = a @ b for 16-bit 2-D device arrays a (M, K), b (K, N) (either may be a transposed view)
    into a C-contiguous float32 out (M, N): one launch, no 16-bit temporary."""
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]) or not out.flags.c_contiguous:
        raise ValueError(f"gemm_into: {a.shape} @ {b.shape} cannot go into {out.shape} (C-contiguous)")
    if a.dtype != b.dtype or not widening(a.dtype, out.dtype):
        raise TypeError(
            f"gemm_into: {a.dtype} @ {b.dtype} into {out.dtype}: give 16-bit operands, float32 out"
        )
    xp = array_module_of(out)
    checked_once(("gemm_into", a.dtype.type), lambda: _probe(xp, a.dtype))
    _launch(a, b, out)


def _probe(xp, dtype):
    """The GEMM on 37 x 96 @ 96 x 53 in each operand layout against a float64 product of the same
    (rounded) operands; bound: K roundings in float32 of terms up to the largest sum of |a||b|."""
    rng = np.random.default_rng(5)
    host_a, host_b = rng.normal(0, 1, (37, 96)).astype(dtype), rng.normal(0, 1, (96, 53)).astype(dtype)
    a64, b64 = host_a.astype(np.float64), host_b.astype(np.float64)
    want = a64 @ b64
    bound = error_bound(np.float32, 96, float(np.max(np.abs(a64) @ np.abs(b64))))
    a, b = xp.asarray(host_a), xp.asarray(host_b)
    layouts = {
        "a @ b": (a, b),
        "a @ b from transposed views": (xp.ascontiguousarray(a.T).T, xp.ascontiguousarray(b.T).T),
    }
    results = []
    for what, (left, right) in layouts.items():
        out = xp.empty((37, 53), dtype=np.float32)
        _launch(left, right, out)
        results.append((what, to_numpy(out), want, bound))
    return results
