"""cuBLAS's gemmEx for a GPU's 2-D GEMMs (matmul routes the linear layers' there): a CUDA graph
captures them, where CuPy's matmul refuses to run while a stream captures, and they are written as
CuPy's matmul cannot write them:

- wider than the operands (float16 or bfloat16 in, float32 out): given a float32 `out` for float16
  operands, CuPy multiplies into a float16 temporary and casts it over (a launch more and a rounding
  to float16 on the way). A weight gradient written straight into the float32 gradient buffer then
  needs neither (issue 30: the unit's gradient is gathered in float32 on a GPU, no cast before its
  reduce-scatter);
- added to what `out` holds (cuBLAS's beta = 1): a projection's GEMM accumulates into its residual
  plus bias, or a LayerNorm-then-linear's into its bias, which the LayerNorm kernel before it wrote
  on its way (fused.py: Seed, _kernel_layer_norm_linear), so the add is not a launch of its own;
- from operands with a leading dimension wider than their rows, as they are: a LayerNorm output
  padded with a column of ones, read with C + 1 columns by the weight gradient's GEMM, which gives
  the bias's gradient as one more row (fused.py's folded bias).

16-bit products accumulate in float32 (CUBLAS_COMPUTE_32F), as CuPy's own float16 GEMMs do; float32
in float32 (no TF32), float64 in float64. Each (operand, output) type pair is checked once against a
float64 product on the host before its first result is used. cuBLAS is called through its C API
(cuda/cublas_api.py), which CUDA graphs capture; tools/gpusim/cupy_standin.py stands in for it, on host
memory, on a machine without a GPU.
"""

from __future__ import annotations

import functools

import numpy as np

from ..base.backend import array_module_of, to_numpy
from ..base.kernels import accumulator, checked_once, device_address, error_bound
from . import cublas_api


@functools.cache
def widening(operands_dtype, out_dtype) -> bool:
    """Whether a product of `operands_dtype` goes into `out_dtype` wider than its operands: a 16-bit
    float into its float32 accumulator (gemm_into writes it; CuPy's matmul would round it first)."""
    return np.dtype(operands_dtype).itemsize == 2 and np.dtype(out_dtype) == np.dtype(
        accumulator(operands_dtype)
    )


@functools.cache
def writes(operands_dtype, out_dtype) -> bool:
    """Whether gemm_into writes a product of `operands_dtype` into `out_dtype`: the same float type,
    or widening."""
    same = (
        np.dtype(out_dtype) == np.dtype(operands_dtype) and np.dtype(out_dtype).name in cublas_api.DATA_TYPES
    )
    return same or widening(operands_dtype, out_dtype)


def _operand(a, itemsize: int):
    """(a, cuBLAS op, leading dimension) for a 2-D operand read column-major as its transpose: a row-
    major a (unit column stride) as it is, a column-major one (a transposed view) transposed; any
    other layout copied first."""
    if a.strides[1] == itemsize and a.strides[0] >= a.shape[1] * itemsize:
        return a, cublas_api.OP_N, a.strides[0] // itemsize
    if a.strides[0] == itemsize and a.strides[1] >= a.shape[0] * itemsize:
        return a, cublas_api.OP_T, a.strides[1] // itemsize
    a = array_module_of(a).ascontiguousarray(a)
    return a, cublas_api.OP_N, a.shape[1]


@functools.cache
def _compute(out_dtype) -> tuple:
    """(cuBLAS compute type, one, zero) for a product into out_dtype: float64 in float64, the rest in
    float32; one and zero on the host, in the compute type (alpha = 1; beta = 1 to add, else 0)."""
    wide = np.dtype(out_dtype) == np.float64
    scalar = np.float64 if wide else np.float32
    return (
        cublas_api.COMPUTE_64F if wide else cublas_api.COMPUTE_32F,
        np.ones(1, scalar),
        np.zeros(1, scalar),
    )


def _launch(a, b, out, accumulate: bool = False):
    """out (M, N), C-contiguous = a (M, K) @ b (K, N) (+ out). cuBLAS is column-major: it computes
    out's transpose (N, M) = b^T a^T, each operand read as the transpose of its row-major self."""
    compute, one, zero = _compute(out.dtype)
    itemsize = a.dtype.itemsize
    (M, K), N = a.shape, b.shape[1]
    b, op_b, ld_b = _operand(b, itemsize)
    a, op_a, ld_a = _operand(a, itemsize)
    beta = (one if accumulate else zero).ctypes.data
    operands = ((device_address(b), b.dtype), ld_b, (device_address(a), a.dtype), ld_a)
    cublas_api.gemm_ex(
        op_b, op_a, N, M, K, one.ctypes.data, *operands, beta, (device_address(out), out.dtype), N, compute
    )


def gemm_into(a, b, out, accumulate: bool = False) -> None:
    """out = a @ b (accumulate: out += a @ b) for 2-D device arrays a (M, K), b (K, N) of one float
    type (either may be a transposed view, or rows of a wider array) into a C-contiguous out (M, N)
    of their type or, for 16-bit operands, float32: one launch, no temporary."""
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]) or not out.flags.c_contiguous:
        raise ValueError(f"gemm_into: {a.shape} @ {b.shape} cannot go into {out.shape} (C-contiguous)")
    if a.dtype != b.dtype or not writes(a.dtype, out.dtype):
        raise TypeError(
            f"gemm_into: {a.dtype} @ {b.dtype} into {out.dtype}: give operands of one float type, and "
            "an out of theirs or (16-bit operands) float32"
        )
    xp = array_module_of(out)
    checked_once(("gemm_into", a.dtype.type, out.dtype.type), lambda: _probe(xp, a.dtype, out.dtype))
    _launch(a, b, out, accumulate)


def matmul(a, b):
    """a @ b for 2-D operands. On a GPU through gemm_into, as CUDA graphs need: CuPy's matmul refuses
    to run while a stream captures (cuda/cublas_api.py). Device arrays only."""
    xp = array_module_of(a)
    if a.dtype != b.dtype or not writes(a.dtype, a.dtype):
        return a @ b
    out = xp.empty((a.shape[0], b.shape[1]), a.dtype)
    gemm_into(a, b, out)
    return out


def _probe(xp, dtype, out_dtype):
    """The GEMM on 37 x 96 @ 96 x 53 in each operand layout, written and accumulated, against a
    float64 product of the same (rounded) operands; bound: K + 1 roundings in the arithmetic's type
    of terms up to the largest sum of |a||b| (+ |out|), and the result's rounding to out's type."""
    rng = np.random.default_rng(5)
    host_a, host_b = rng.normal(0, 1, (37, 96)).astype(dtype), rng.normal(0, 1, (96, 53)).astype(dtype)
    host_c = rng.normal(0, 1, (37, 53)).astype(out_dtype)
    a64, b64, c64 = (m.astype(np.float64) for m in (host_a, host_b, host_c))
    scale = float(np.max(np.abs(a64) @ np.abs(b64) + np.abs(c64)))
    bound = error_bound(out_dtype, 97, scale)
    a, b = xp.asarray(host_a), xp.asarray(host_b)
    layouts = {
        "a @ b": (a, b),
        "a @ b from transposed views": (xp.ascontiguousarray(a.T).T, xp.ascontiguousarray(b.T).T),
    }
    results = []
    for what, (left, right) in layouts.items():
        for accumulate in (False, True):
            out = xp.array(host_c)  # a copy: each launch starts from host_c
            _launch(left, right, out, accumulate)
            want = a64 @ b64 + (c64 if accumulate else 0)
            results.append((what + (" + out" if accumulate else ""), to_numpy(out), want, bound))
    return results
