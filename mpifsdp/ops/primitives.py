"""The primitives: each forward next to its VJP, registered in autodiff.PRIMITIVES.

The transformer's fused kernels (linear, GELU, LayerNorm, cross-entropy) live in fused.py, attention in
causal_attention.py.

Forward: (*arrays, **settings) -> (out, saved). VJP: (g, saved, *arrays, **settings) -> grads.
`saved` holds activations only, never parameter arrays (see autodiff, lazy parameter data).
The array module comes from the inputs (`array_module_of`), so every primitive runs on NumPy and CuPy.
The functional API over them (what layers and users call) is functional.py; the loss, loss.py.
"""

from __future__ import annotations

import math

import numpy as np

from ..autodiff.tensor import primitive
from ..base import deferred
from ..base.backend import array_module_of, host_values, scatter_add
from .causal_attention import swap_last  # importing attention (and fused) registers their primitives


def unbroadcast(g, shape):
    """Sum `g` down to `shape`, undoing NumPy broadcasting (leading axes and size-1 axes)."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and g.shape[axis] != 1:
            g = g.sum(axis=axis, keepdims=True)
    return g


# -- elementwise arithmetic ----------------------------------------------------------------------


@primitive(
    "add", vjp=lambda g, _, a, b: (unbroadcast(g, a.shape), unbroadcast(g, b.shape)), reads_inputs=False
)
def _add(a, b):
    return a + b, None


@primitive(
    "sub", vjp=lambda g, _, a, b: (unbroadcast(g, a.shape), unbroadcast(-g, b.shape)), reads_inputs=False
)
def _sub(a, b):
    return a - b, None


@primitive("mul", vjp=lambda g, _, a, b: (unbroadcast(g * b, a.shape), unbroadcast(g * a, b.shape)))
def _mul(a, b):
    return a * b, None


@primitive(
    "div", vjp=lambda g, _, a, b: (unbroadcast(g / b, a.shape), unbroadcast(-g * a / (b * b), b.shape))
)
def _div(a, b):
    return a / b, None


@primitive("neg", vjp=lambda g, _, a: (-g,), reads_inputs=False)
def _neg(a):
    return -a, None


@primitive("pow", vjp=lambda g, _, a, exponent: (g * exponent * a ** (exponent - 1),))
def _pow(a, exponent):
    return a**exponent, None


@primitive("exp", vjp=lambda g, out, a: (g * out,), reads_inputs=False)
def _exp(a):
    out = array_module_of(a).exp(a)
    return out, out


@primitive("log", vjp=lambda g, _, a: (g / a,))
def _log(a):
    return array_module_of(a).log(a), None


@primitive("tanh", vjp=lambda g, out, a: (g * (1 - out * out),), reads_inputs=False)
def _tanh(a):
    out = array_module_of(a).tanh(a)
    return out, out


@primitive("sqrt", vjp=lambda g, out, a: (g / (2 * out),), reads_inputs=False)
def _sqrt(a):
    out = array_module_of(a).sqrt(a)
    return out, out


@primitive("relu", vjp=lambda g, _, a: (g * (a > 0),))
def _relu(a):
    return array_module_of(a).maximum(a, 0), None


# -- linear algebra -------------------------------------------------------------------------------


@primitive(
    "matmul",
    vjp=lambda g, _, a, b: (
        unbroadcast(g @ swap_last(b), a.shape),
        unbroadcast(swap_last(a) @ g, b.shape),
    ),
)
def _matmul(a, b):
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs arrays of 2 or more dims, got shapes {a.shape} and {b.shape}")
    return a @ b, None


# -- reductions and shape ops ---------------------------------------------------------------------


def _expand_reduced(g, shape, axis, keepdims):
    """Give a reduced gradient back the reduced axes so it broadcasts against the input."""
    if axis is not None and not keepdims:
        axes = (axis,) if isinstance(axis, int) else axis
        g = array_module_of(g).expand_dims(g, tuple(a % len(shape) for a in axes))
    elif axis is None and not keepdims:
        g = g.reshape((1,) * len(shape))
    return g


def _reduced_count(shape, axis):
    if axis is None:
        return math.prod(shape)
    axes = (axis,) if isinstance(axis, int) else axis
    return math.prod(shape[a] for a in axes)


@primitive(
    "sum",
    vjp=lambda g, _, a, axis=None, keepdims=False: (
        array_module_of(g).broadcast_to(_expand_reduced(g, a.shape, axis, keepdims), a.shape),
    ),
    reads_inputs=False,
)
def _sum(a, axis=None, keepdims=False):
    return a.sum(axis=axis, keepdims=keepdims), None


@primitive(
    "mean",
    vjp=lambda g, _, a, axis=None, keepdims=False: (
        array_module_of(g).broadcast_to(
            _expand_reduced(g, a.shape, axis, keepdims) / _reduced_count(a.shape, axis), a.shape
        ),
    ),
    reads_inputs=False,
)
def _mean(a, axis=None, keepdims=False):
    return a.mean(axis=axis, keepdims=keepdims), None


def _max_vjp(g, out, a, axis=None, keepdims=False):
    """Ties share the gradient equally."""
    hit = a == _expand_reduced(out, a.shape, axis, keepdims)
    share = hit / hit.sum(axis=axis, keepdims=True)
    return (_expand_reduced(g, a.shape, axis, keepdims) * share,)


@primitive("max", vjp=_max_vjp)
def _max(a, axis=None, keepdims=False):
    out = a.max(axis=axis, keepdims=keepdims)
    return out, out


@primitive("astype", vjp=lambda g, _, a, dtype: (g.astype(a.dtype),), reads_inputs=False)
def _astype(a, dtype):
    """A cast, e.g. half-precision logits to float32 before the loss; the gradient casts back."""
    return a.astype(dtype), None


@primitive("reshape", vjp=lambda g, _, a, shape: (g.reshape(a.shape),), reads_inputs=False)
def _reshape(a, shape):
    return a.reshape(shape), None


@primitive(
    "transpose",
    vjp=lambda g, _, a, axes=None: (g.transpose(None if axes is None else np.argsort(axes)),),
    reads_inputs=False,
)
def _transpose(a, axes=None):
    return a.transpose(axes), None


def _is_basic_index(index) -> bool:
    """Ints, slices, Ellipsis and None select each element at most once: plain assignment suffices."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, slice)) or i is Ellipsis or i is None for i in parts)


def _getitem_vjp(g, _, a, index):
    grad = array_module_of(g).zeros(a.shape, dtype=g.dtype)
    if _is_basic_index(index):
        grad[index] = g
        return (grad,)
    return (scatter_add(grad, index, g),)


@primitive("getitem", vjp=_getitem_vjp, reads_inputs=False)
def _getitem(a, index):
    return a[index], None


def _concatenate_vjp(g, _, *arrays, axis):
    xp = array_module_of(g)
    cuts = np.cumsum([a.shape[axis] for a in arrays])[:-1]
    return tuple(xp.split(g, cuts, axis=axis))


@primitive("concatenate", vjp=_concatenate_vjp, reads_inputs=False)
def _concatenate(*arrays, axis=0):
    return array_module_of(arrays[0]).concatenate(arrays, axis=axis), None


# -- softmax family --------------------------------------------------------------------


@primitive(
    "softmax",
    vjp=lambda g, p, x, axis=-1: (p * (g - (g * p).sum(axis=axis, keepdims=True)),),
    reads_inputs=False,
)
def _softmax(x, axis=-1):
    p = x - x.max(axis=axis, keepdims=True)
    array_module_of(x).exp(p, out=p)
    p /= p.sum(axis=axis, keepdims=True)
    return p, p


@primitive(
    "log_softmax",
    vjp=lambda g, out, x, axis=-1: (g - array_module_of(g).exp(out) * g.sum(axis=axis, keepdims=True),),
    reads_inputs=False,
)
def _log_softmax(x, axis=-1):
    xp = array_module_of(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
    return out, out


def _embedding_vjp(g, idx_on_device, w, idx):
    gw = array_module_of(g).zeros_like(w)
    idx = idx if idx_on_device is None else idx_on_device
    return (scatter_add(gw, idx.reshape(-1), g.reshape(-1, w.shape[1])),)


def _out_of_range(ends, rows: int) -> str:
    low, high = int(ends[0]), int(ends[1])
    return f"embedding index out of range: indices span [{low}, {high}] but the table has {rows} rows"


def check_indices(w, idx):
    """Integer indices within w's rows; indices on a device are checked there, read with the step's
    verdict (base/deferred.py): the check reads nothing back of its own."""
    if idx.dtype.kind not in "iu":
        raise TypeError(f"embedding indices must be integers, got {idx.dtype}")
    if idx.size:
        ends = array_module_of(idx).stack([idx.min(), idx.max()])
        message = lambda: _out_of_range(host_values(ends, "an input check"), w.shape[0])  # noqa: E731
        deferred.check((ends[0] < 0) | (ends[1] >= w.shape[0]), IndexError, message)


@primitive("embedding", vjp=_embedding_vjp)
def _embedding(w, idx):
    """w[idx] (the indices checked first)."""
    check_indices(w, idx)
    return w[idx], None


@primitive("dropout", vjp=lambda g, keep, x, p, seed: (g * keep,), reads_inputs=False)
def _dropout(x, p, seed):
    """Inverted dropout; the mask comes from a host RNG seeded by `seed`, identical on every device."""
    mask = np.random.default_rng(seed).random(x.shape) >= p
    keep = array_module_of(x).asarray(mask, dtype=x.dtype) / (1.0 - p)
    return x * keep, keep
