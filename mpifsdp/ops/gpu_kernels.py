"""Fused passes as single CuPy kernels: the GPU twins of fused.py's GELU, attention.py's causal
softmax and its backward, and optim.py's AdamW update (base/kernels.py: what every raw kernel
shares). gpu_layer_norm.py and gpu_cross_entropy.py hold the LayerNorm and cross-entropy kernels.

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
    "adamw": (  # optim.adamw_update's arithmetic, in its order, on whole vectors, the decay included
        "T g, raw int64 decay_from, raw int64 decay_to, int32 segments, T decay,"
        " T beta1, T one_minus_beta1, T beta2, T one_minus_beta2, T lr_over_bias1, T bias2, T eps",
        "T p, T m, T v",
        "for (int k = 0; k < segments; ++k) if (i >= decay_from[k] && i < decay_to[k]) p = p * decay;"
        " m = m * beta1 + g * one_minus_beta1; v = v * beta2 + (g * g) * one_minus_beta2;"
        " p -= m / (sqrt(v) / bias2 + eps) * lr_over_bias1;",
    ),
}


# how many of a kernel's last inputs are passed as scalars, not arrays (for the NVRTC check, which
# builds each kernel as CuPy would for its call)
SCALAR_INPUTS = {"adamw": 9}


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


def adamw_into(p, g, m, v, beta1, beta2, lr_over_bias1, bias2, eps, decay=1.0, decay_segments=()):
    """p, m, v updated in place; p *= decay first inside decay_segments ((start, stop) pairs). One
    launch however many segments (each segment's `p[a:b] *= decay` was a launch and a copy: 1,168
    launches of a 24-layer GPT's step). The scalars are computed in Python and take the arrays'
    dtype, as NumPy's in-place ufuncs take them (so 1 - beta1 is not recomputed in float32)."""
    cupy = array_module_of(p)
    starts, stops = _segment_arrays(cupy, tuple(decay_segments) or ((0, 0),))
    scalars = (decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, lr_over_bias1, bias2, eps)
    typed = (p.dtype.type(s) for s in scalars)
    _run("adamw", g, starts, stops, np.int32(len(decay_segments)), *typed, p, m, v)


@functools.lru_cache(maxsize=1024)
def _segment_arrays(cupy, segments: tuple):
    """A group's decay segments on the device (its starts, its stops), copied there once."""
    table = np.array(segments, dtype=np.int64).reshape(-1, 2)
    return cupy.asarray(table[:, 0].copy()), cupy.asarray(table[:, 1].copy())


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


def row_source(dtype) -> str:
    return typed_source(dtype, f"#define ITEMS {_ROW_ITEMS}\n" + ROW_SOURCE)


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
