"""Fused passes as single CuPy kernels: the GPU twins of fused.py's GELU, attention.py's causal
softmax and its backward, and optim.py's AdamW update.

On the CPU those run as several NumPy passes over cache-sized chunks; on a GPU each pass is a kernel
launch and a trip through device memory, so the same arithmetic is done in one kernel that reads
each element once. The formulas are the NumPy ones; float16 computes in float32 and rounds once (the
NumPy path rounds after every pass). tests/unit/ops/test_gpu_kernels.py holds both paths to the same float64
formulas, and the attention and parity checks to each other. Kernels are compiled by CuPy on first
use and cached; nothing here imports CuPy.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np

from ..base.backend import array_module_of

log = logging.getLogger(__name__)

_C = math.sqrt(2.0 / math.pi)  # GELU (tanh form): u = c (x + k x^3), gelu = x sigmoid(2u)
_K = 0.044715

# A: the type a kernel computes in, float for float16 and float32, double for float64.
_PREAMBLE = f"""
template <typename T> struct Acc {{ typedef float type; }};
template <> struct Acc<double> {{ typedef double type; }};
#define GELU_SIGMOID(x) (A(1) / (A(1) + exp(x * (A({-2 * _C!r}) + A({-2 * _C * _K!r}) * x * x))))
#define GELU_SLOPE(x, s) (s * (A(1) + x * (A({2 * _C!r}) + A({6 * _C * _K!r}) * x * x) * (A(1) - s)))
"""

_SOURCES = {
    "gelu": ("T x", "T y", "typedef Acc<T>::type A; A a = (A)x; y = (T)(a * GELU_SIGMOID(a));"),
    "gelu_grad": (
        "T g, T x",
        "T y",
        "typedef Acc<T>::type A; A a = (A)x; A s = GELU_SIGMOID(a); y = (T)((A)g * GELU_SLOPE(a, s));",
    ),
    "gelu_and_grad": (  # h = gelu(x) and gh *= gelu'(x) from one sigmoid (the MLP's backward)
        "T x",
        "T h, T gh",
        "typedef Acc<T>::type A; A a = (A)x; A s = GELU_SIGMOID(a); h = (T)(a * s);"
        " gh = (T)((A)gh * GELU_SLOPE(a, s));",
    ),
    "adamw": (  # optim.adamw_update's arithmetic, in its order, on whole vectors
        "T g, T beta1, T one_minus_beta1, T beta2, T one_minus_beta2, T lr_over_bias1, T bias2, T eps",
        "T p, T m, T v",
        "m = m * beta1 + g * one_minus_beta1; v = v * beta2 + (g * g) * one_minus_beta2;"
        " p -= m / (sqrt(v) / bias2 + eps) * lr_over_bias1;",
    ),
}


@functools.cache
def _kernel(cupy, name: str):
    in_params, out_params, operation = _SOURCES[name]
    return cupy.ElementwiseKernel(in_params, out_params, operation, f"mpifsdp_{name}", preamble=_PREAMBLE)


def _run(name: str, *arrays):
    return _kernel(array_module_of(arrays[0]), name)(*arrays)


def gelu_into(out, x):
    _run("gelu", x, out)


def gelu_grad_into(out, g, x):
    _run("gelu_grad", g, x, out)


def gelu_and_grad_into(h, gh, x):
    _run("gelu_and_grad", x, h, gh)


def adamw_into(p, g, m, v, beta1, beta2, lr_over_bias1, bias2, eps):
    """p, m, v updated in place. The scalars are computed in Python and take the arrays' dtype, as
    NumPy's in-place ufuncs take them (so 1 - beta1 is not recomputed in float32)."""
    scalars = (beta1, 1.0 - beta1, beta2, 1.0 - beta2, lr_over_bias1, bias2, eps)
    _run("adamw", g, *(p.dtype.type(s) for s in scalars), p, m, v)


# -- causal softmax over rows of (heads, T, T) scores: one thread block per row --------------------
# The scores of one row are read once into registers (T <= 1024 = 256 threads x 4), so the forward
# is one read and one write per element (the NumPy path: seven passes), and the backward
# d = p (d - rowsum(d p)) scale is two reads and one write.
_ROW_THREADS, _ROW_ITEMS = 256, 4
_ROW_SOURCE = r"""
#include <cuda_fp16.h>
#define NEG_INF (-(ACC)__int_as_float(0x7f800000))
__device__ __forceinline__ ACC block_reduce(ACC v, bool is_max) {
    __shared__ ACC part[32];
    for (int o = 16; o > 0; o >>= 1) {
        ACC w = __shfl_xor_sync(0xffffffff, v, o);
        v = is_max ? max(v, w) : v + w;
    }
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = part[0];
    for (int k = 1; k < (int)(blockDim.x >> 5); ++k) v = is_max ? max(v, part[k]) : v + part[k];
    __syncthreads();
    return v;
}
extern "C" __global__ void causal_softmax(ELEM* s, const int T, const ACC scale) {
    const int q = blockIdx.x % T;  /* this row's query position: keys after it are masked */
    ELEM* row = s + (size_t)blockIdx.x * T;
    ACC x[ITEMS];
    ACC m = NEG_INF;
    for (int i = 0; i < ITEMS; ++i) {
        int j = threadIdx.x + i * blockDim.x;
        x[i] = (j < T && j <= q) ? (ACC)row[j] * scale : NEG_INF;
        m = max(m, x[i]);
    }
    m = block_reduce(m, true);
    ACC l = 0;
    for (int i = 0; i < ITEMS; ++i) { x[i] = exp(x[i] - m); l += x[i]; }
    l = block_reduce(l, false);
    for (int i = 0; i < ITEMS; ++i) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < T) row[j] = (ELEM)(x[i] / l);
    }
}
extern "C" __global__ void softmax_backward(ELEM* d, const ELEM* p, const int T, const ACC scale) {
    ELEM* drow = d + (size_t)blockIdx.x * T;
    const ELEM* prow = p + (size_t)blockIdx.x * T;
    ACC dot = 0;
    for (int j = threadIdx.x; j < T; j += blockDim.x) dot += (ACC)drow[j] * (ACC)prow[j];
    dot = block_reduce(dot, false);
    for (int j = threadIdx.x; j < T; j += blockDim.x)
        drow[j] = (ELEM)((ACC)prow[j] * ((ACC)drow[j] - dot) * scale);
}
"""
_ROW_TYPES = {
    np.float16: ("__half", "float"),
    np.float32: ("float", "float"),
    np.float64: ("double", "double"),
}


@functools.cache
def _row_kernels(cupy, dtype):
    """(softmax, backward) for `dtype`, or None where NVRTC cannot build them (then the caller keeps
    its array-module passes, with one warning)."""
    elem, acc = _ROW_TYPES[dtype]
    source = f"#define ELEM {elem}\n#define ACC {acc}\n#define ITEMS {_ROW_ITEMS}\n" + _ROW_SOURCE
    try:
        module = cupy.RawModule(code=source, options=("--std=c++17",))
        return module.get_function("causal_softmax"), module.get_function("softmax_backward")
    except Exception as exc:  # a CUDA toolkit without cuda_fp16.h for NVRTC, say
        log.warning("fused causal softmax unavailable for %s (%s): using unfused passes", elem, exc)
        return None


def _row_launch(which: int, rows, T: int, scale: float, *arrays) -> bool:
    """Run kernel `which` over `rows` rows of T; False when it cannot run (T too long, no kernel)."""
    kernels = _row_kernels(array_module_of(arrays[0]), arrays[0].dtype.type)
    if kernels is None or T > _ROW_THREADS * _ROW_ITEMS:
        return False
    acc = np.float64 if arrays[0].dtype == np.float64 else np.float32
    kernels[which]((rows,), (_ROW_THREADS,), (*arrays, np.int32(T), acc(scale)))
    return True


def causal_softmax_(scores3, scale: float) -> bool:
    """scores3 (heads, T, T) contiguous, in place: softmax(scores * scale + causal mask) per row."""
    return _row_launch(0, scores3.shape[0] * scores3.shape[1], scores3.shape[2], scale, scores3)


def softmax_backward_(d3, p3, scale: float) -> bool:
    """d3 in place: p (d - rowsum(d p)) scale, the gradient of the scores from that of p."""
    return _row_launch(1, d3.shape[0] * d3.shape[1], d3.shape[2], scale, d3, p3)
