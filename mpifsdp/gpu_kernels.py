"""Fused elementwise passes as single CuPy kernels: the GPU twins of fused.py's GELU and optim.py's
AdamW update.

On the CPU those run as several NumPy passes over cache-sized chunks; on a GPU each pass is a kernel
launch and a trip through device memory, so the same arithmetic is done in one kernel that reads
each element once. The formulas and their order of operations are the NumPy ones (float16 computes
in float32, as NumPy's float16 ufuncs do); tests/test_gpu_kernels.py holds each against its NumPy
twin. Kernels are compiled by CuPy on first use and cached; nothing here imports CuPy.
"""

from __future__ import annotations

import functools
import math

from .backend import array_module_of

_C = math.sqrt(2.0 / math.pi)  # GELU (tanh form): u = c (x + k x^3), gelu = x sigmoid(2u)
_K = 0.044715

# A: the type a kernel computes in, float for float16 and float32, double for float64.
_PREAMBLE = f"""
template <typename T> struct Acc {{ typedef float type; }};
template <> struct Acc<double> {{ typedef double type; }};
#define GELU_SIGMOID(x) (A(1) / (A(1) + exp(x * (A({-2 * _C!r}) - A({-2 * _C * _K!r}) * x * x))))
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
