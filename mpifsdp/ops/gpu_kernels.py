"""Fused passes as single CuPy kernels: the GPU twins of fused.py's GELU and of attention.py's
causal softmax and its backward (base/kernels.py: what every raw kernel shares; AdamW's kernel is
optim/gpu_adamw.py; gpu_layer_norm.py and gpu_cross_entropy.py hold the LayerNorm and
cross-entropy kernels).

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
from ..base.kernels import ELEMENT_TYPES, RAW_FAMILIES, TWINS, accumulator, compiled, typed_source

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
    # a projection's bias and the residual stream added to its GEMM's output in one pass, rounded
    # after each add as the two separate adds round (the same bits as them)
    "bias_residual": ("T y, T b, T r", "T out", "out = (T)((T)(y + b) + r);"),
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


def add_bias_residual_(y, b, r):
    """y = (y + b) + r in place, b broadcast over y's rows."""
    _run("bias_residual", y, b, r, y)


# -- causal softmax over rows of (heads, T, T) scores: one thread block per row --------------------
# The scores of one row are read once into registers (T <= 1024 = 256 threads x 4), so the forward
# is one read and one write per element (the NumPy path: seven passes), and the backward
# d = p (d - rowsum(d p)) scale is two reads and one write.
_ROW_THREADS, _ROW_ITEMS = 256, 4
ROW_SOURCE = r"""
#define NEG_INF (-(ACC)__int_as_float(0x7f800000))
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
ROW_KERNELS = ("causal_softmax", "softmax_backward")
_ROW_BODY = f"#define ITEMS {_ROW_ITEMS}\n" + ROW_SOURCE


def row_source(dtype) -> str:
    return typed_source(dtype, _ROW_BODY)


def _causal_softmax_twin(grid, block, args, shared_mem=0):
    s, T, scale = args
    rows = s.reshape(-1, T, T)
    masked = rows.astype(np.float64) * float(scale) + np.triu(np.full((T, T), -np.inf), 1)
    e = np.exp(masked - masked.max(-1, keepdims=True))
    rows[...] = e / e.sum(-1, keepdims=True)


def _softmax_backward_twin(grid, block, args, shared_mem=0):
    d, p, T, scale = args
    d3, p3 = d.reshape(-1, T, T), p.reshape(-1, T, T).astype(np.float64)
    d64 = d3.astype(np.float64)
    d3[...] = p3 * (d64 - (d64 * p3).sum(-1, keepdims=True)) * float(scale)


TWINS.update(causal_softmax=_causal_softmax_twin, softmax_backward=_softmax_backward_twin)
RAW_FAMILIES["causal softmax"] = (row_source, ROW_KERNELS)


def _row_launch(which: int, rows, T: int, scale: float, *arrays) -> bool:
    """Run kernel `which` over `rows` rows of T; False when it cannot run (T too long, no kernel)."""
    dtype = arrays[0].dtype.type
    if dtype not in ELEMENT_TYPES or T > _ROW_THREADS * _ROW_ITEMS:
        return False
    kernels = compiled(array_module_of(arrays[0]), row_source(dtype), ROW_KERNELS, "fused causal softmax")
    if kernels is None:
        return False
    kernels[which]((rows,), (_ROW_THREADS,), (*arrays, np.int32(T), accumulator(dtype)(scale)))
    return True


def causal_softmax_(scores3, scale: float) -> bool:
    """scores3 (heads, T, T) contiguous, in place: softmax(scores * scale + causal mask) per row."""
    return _row_launch(0, scores3.shape[0] * scores3.shape[1], scores3.shape[2], scale, scores3)


def softmax_backward_(d3, p3, scale: float) -> bool:
    """d3 in place: p (d - rowsum(d p)) scale, the gradient of the scores from that of p."""
    return _row_launch(1, d3.shape[0] * d3.shape[1], d3.shape[2], scale, d3, p3)
