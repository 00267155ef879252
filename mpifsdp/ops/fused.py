"""The fused transformer primitives: linear (optionally of GELU), GELU, LayerNorm, cross-entropy
(causal attention: causal_attention.py). Registered like every primitive (forward next to VJP).

On the CPU their elementwise work runs in blocks of rows across this rank's threads
(threads.for_row_blocks), so the cores BLAS uses for GEMMs are not idle in between; on a GPU each
kernel runs as one piece. Memory: none of them keeps more than it must for backward: GELU,
LayerNorm and attention recompute from their inputs (attention's probabilities exist only inside the
op and its VJP, and beyond ATTENTION_BLOCK positions only one block pair at a time), cross-entropy
keeps one log-sum-exp per row.
"""

from __future__ import annotations

import math

import numpy as np

from ..autodiff.tape import WROTE, Summed, SumsWritten
from ..autodiff.tensor import primitive
from ..base import deferred
from ..base.backend import array_module_of
from ..base.kernels import accumulator, device_address
from ..base.threads import for_row_blocks
from . import gpu_cross_entropy, gpu_gemm, gpu_kernels, gpu_layer_norm

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def _rows(a):
    """A 2-D (rows, last axis) view of a contiguous array."""
    return a.reshape(-1, a.shape[-1])


def by_rows(xp, n_rows: int, row_elements: int, work, calls_blas: bool = False, align: int = 1) -> int:
    """work(i, lo, hi) over blocks of rows on the CPU; in one piece (i = 0) on a GPU. calls_blas:
    work runs GEMMs (threads.for_row_blocks then keeps BLAS to one thread per block); align: the
    blocks' bounds at multiples of it."""
    if xp is np:
        return for_row_blocks(n_rows, row_elements, work, calls_blas, align)
    work(0, 0, n_rows)
    return 1


# -- GELU (tanh form, as GPT-2) -------------------------------------------------------------------
# 0.5 (1 + tanh(u)) = sigmoid(2u), so gelu(x) = x / (1 + exp(-2u)) with u = c (x + k x^3): one exp
# instead of a tanh (measured here on 2M float32: 21.9 ms vs 25.1 ms a thread). Each thread's rows
# run in chunks of CHUNK elements, so the seven passes of a chunk stay in cache (15.8 ms vs 21.9).

CHUNK = 1 << 16  # elements an elementwise kernel works on at once (256 KiB of float32)


def _in_chunks(kernel, out, *inputs):
    """kernel(out, *inputs, scratch) on CHUNK-element pieces of contiguous arrays of one size on the
    CPU. On a GPU its one-kernel twin (gpu_kernels.py) over the whole arrays instead: each piece
    and each pass costs launches there (measured on an H200: GELU in 64 K-element pieces made an
    MLP layer's forward and backward 40x slower than its GEMMs)."""
    xp = array_module_of(out)
    if xp is not np:
        return _GPU_TWINS[kernel](out, *inputs)
    flat = [a.reshape(-1) for a in (out, *inputs)]
    n = flat[0].size
    scratch = [xp.empty(min(CHUNK, n), dtype=out.dtype) for _ in range(3)]
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        kernel(*(a[start:stop] for a in flat), *(s[: stop - start] for s in scratch))


def row_slices(xp, lo: int, hi: int, row_elements: int):
    """Sub-ranges of rows [lo, hi) of about CHUNK elements on the CPU: a kernel's passes over one
    stay in cache, and its temporaries stay small. On a GPU one range: each slice costs kernel
    launches (thousands per step at vocabulary 32K), and a GPU has no cache to fit."""
    step = max(1, CHUNK // max(1, row_elements)) if xp is np else max(1, hi - lo)
    return ((a, min(a + step, hi)) for a in range(lo, hi, step))


def _sigmoid_2u_into(out, x):
    """out = sigmoid(2 c (x + k x^3)) = 0.5 (1 + tanh(u))."""
    xp = array_module_of(x)
    xp.multiply(x, x, out=out)
    out *= -2 * _GELU_C * _GELU_K
    out -= 2 * _GELU_C
    out *= x
    xp.exp(out, out=out)  # an overflow to inf gives sigmoid 0, as it should
    out += 1
    xp.reciprocal(out, out=out)


def _gelu_into(out, x, *scratch):
    _sigmoid_2u_into(out, x)
    out *= x


def _gelu_slope_into(out, x, s, t):
    """out = d gelu / dx = s (1 + a (1 - s)), given s = sigmoid(2u); a = 2 x u' = 2 c x (1 + 3k x^2)."""
    xp = array_module_of(x)
    xp.multiply(x, x, out=out)
    out *= 6 * _GELU_C * _GELU_K
    out += 2 * _GELU_C
    out *= x
    xp.multiply(out, s, out=t)
    out -= t
    out += 1
    out *= s


def _gelu_grad_into(out, g, x, s, t, _):
    _sigmoid_2u_into(s, x)
    _gelu_slope_into(out, x, s, t)
    out *= g


def _gelu_and_grad_into(h, gh, x, s, t, u):
    """h = gelu(x) and gh *= gelu'(x) in one pass over x, from one sigmoid (the MLP's backward)."""
    _sigmoid_2u_into(s, x)
    array_module_of(x).multiply(x, s, out=h)
    _gelu_slope_into(t, x, s, u)
    gh *= t


_GPU_TWINS = {
    _gelu_into: gpu_kernels.gelu_into,
    _gelu_grad_into: gpu_kernels.gelu_grad_into,
    _gelu_and_grad_into: gpu_kernels.gelu_and_grad_into,
}


def gelu_array(x, bias=None):
    """gelu(x (+ bias over x's rows)); on a GPU the bias is added inside the GELU's one kernel."""
    xp = array_module_of(x)
    out = xp.empty_like(x)
    if bias is not None and xp is not np and x.flags.c_contiguous:
        gpu_kernels.gelu_bias_into(out, x, bias)
        return out
    if bias is not None:
        x = x + bias
    x2, o2 = _rows(x), _rows(out)
    by_rows(xp, x2.shape[0], x2.shape[1], lambda i, lo, hi: _in_chunks(_gelu_into, o2[lo:hi], x2[lo:hi]))
    return out


def _gelu_grad(g, x):
    xp = array_module_of(x)
    out = xp.empty_like(x)
    x2, g2, o2 = _rows(x), _rows(xp.ascontiguousarray(g)), _rows(out)

    def work(i, lo, hi):
        _in_chunks(_gelu_grad_into, o2[lo:hi], g2[lo:hi], x2[lo:hi])

    by_rows(xp, x2.shape[0], x2.shape[1], work)
    return out


@primitive("gelu", vjp=lambda g, _, x: (_gelu_grad(g, x),))
def _gelu(x):
    """GELU; saves nothing: the VJP recomputes tanh from x, which the tape keeps anyway."""
    return gelu_array(x), None


# -- linear ---------------------------------------------------------------------------------------


def writable(into, k: int, shape, *dtypes):
    """into[k] where a VJP may write input k's gradient itself (primitive's takes_into): a fresh
    parameter gradient of the gradient's shape and of one of `dtypes` (what the VJP can write: a
    unit gathers 16-bit parameters' gradients in float32 on a GPU; on the CPU, the first, the
    operands' type); None otherwise (the VJP returns it, to be added)."""
    target = None if into is None else into[k]
    if target is None:
        return None
    if array_module_of(target) is np:
        dtypes = dtypes[:1]
    fits = target.shape == tuple(shape) and target.dtype in dtypes and target.flags.c_contiguous
    return target if fits else None


def _weight_grad_into(a, c, target):
    """target = a @ c, a fresh parameter gradient in the operands' type or their float32
    accumulator (cuBLAS's gemmEx: no 16-bit temporary, no cast); on the CPU NumPy's, the same call
    as without `out` (the same bits)."""
    if array_module_of(target) is not np and a.dtype == c.dtype and gpu_gemm.writes(a.dtype, target.dtype):
        gpu_gemm.gemm_into(a, c, target)
    else:
        array_module_of(a).matmul(a, c, out=target)


def _linear_vjp(
    g,
    _,
    x,
    w,
    b=None,
    transpose_w=False,
    gelu_input=False,
    needs=(True, True, True),
    into=None,
    sums_into=None,
    gelu_bias=None,
):
    """needs: which of x, w, b (and gelu_bias) want a gradient (a frozen weight's GEMM is skipped,
    and so is the input's where nothing upstream trains). into: the GEMM writes the weight's
    gradient, and the column sum the bias's, into a fresh parameter gradient directly (tape.WROTE).
    sums_into: with gelu_input on a GPU, the kernel forming x's gradient writes its column sums
    into sums_into[0] where offered (tape.SumsWritten: the bias gradient of the MLP's first
    linear). gelu_bias: the linear's input is gelu(x + gelu_bias) (linear_add's); its
    gradient, the column sums of x's, comes after the others."""
    g2 = _rows(g)
    gx, gw, gb, g_gelu_bias = None, None, None, None
    h = x
    wants_bias = gelu_bias is not None and needs[3]
    if needs[0] or wants_bias:
        gx = gpu_gemm.matmul(g2, w.T if not transpose_w else w).reshape(x.shape)  # d/d(input of the GEMM)
    if gelu_input and (needs[0] or wants_bias):  # gelu recomputed (cheaper than keeping (B, T, 4C))
        h, gx, g_gelu_bias = _gelu_backward(x, gx, (sums_into or (None,))[0], gelu_bias, into)
    elif gelu_input and needs[1]:
        h = gelu_array(x, gelu_bias)
    if needs[1]:
        h2 = _rows(h)
        a, c = (h2.T, g2) if not transpose_w else (g2.T, h2)
        gw = writable(into, 1, w.shape, *_written_types(g2.dtype))
        if gw is None:
            gw = gpu_gemm.matmul(a, c)
        else:
            _weight_grad_into(a, c, gw)
            gw = WROTE
    if b is not None and needs[2]:
        gb = writable(into, 2, b.shape, g2.dtype, accumulator(g2.dtype.type))
        if gb is None:
            gb = g2.sum(axis=0)
        else:
            g2.sum(axis=0, dtype=gb.dtype, out=gb)
            gb = WROTE
    grads = (gx if needs[0] else None, gw) + (() if b is None else (gb,))
    return grads if gelu_bias is None else (*grads, g_gelu_bias if wants_bias else None)


def _gelu_backward(x, gx, sums, bias, into):
    """(gelu(x (+ bias)), gx * gelu'(x (+ bias)), the bias's gradient or None), gx scaled in place.
    On a GPU one kernel, which also writes the column sums of the result: the bias's gradient
    (into[4] where it is a zeroed parameter gradient) or, with no bias, that of x's producer's
    (`sums`, tape.SumsWritten: the result is returned wrapped)."""
    xp = array_module_of(x)
    h, x2, gx2 = xp.empty_like(x), _rows(x), _rows(gx)
    h2 = _rows(h)
    if bias is not None:
        acc = accumulator(gx.dtype.type)
        target = writable(into, 4, bias.shape, acc)
        sums = target if target is not None or xp is np else xp.empty(bias.shape, acc)
    if xp is not np and sums is not None and gpu_kernels.gelu_and_grad_sums_into(h2, gx2, x2, sums, bias):
        if bias is None:
            return h, SumsWritten(gx), None
        return h, gx, WROTE if sums is target else sums.astype(bias.dtype)
    if bias is not None:  # the passes below on x + bias, as the forward's gelu_array
        x2 = x2 + bias

    def work(i, lo, hi):
        _in_chunks(_gelu_and_grad_into, h2[lo:hi], gx2[lo:hi], x2[lo:hi])

    by_rows(xp, x2.shape[0], x2.shape[1], work)
    return h, gx, None if bias is None else gx2.sum(axis=0)


def _written_types(dtype) -> tuple:
    """The dtypes a GEMM of `dtype` operands can write a weight gradient in: theirs, and their
    float32 accumulator where they are 16-bit (gpu_gemm.widening)."""
    acc = np.dtype(accumulator(dtype.type))
    return (dtype, acc) if gpu_gemm.widening(dtype, acc) else (dtype,)


def _bias_is_input_2(settings, inputs: int):
    """A linear's bias: its third input, where it has one (tape.SumsWritten)."""
    return 2 if inputs > 2 else None


@primitive(
    "linear",
    vjp=_linear_vjp,
    takes_needs=True,
    takes_into=True,
    gives_column_sums=True,
    bias_input=_bias_is_input_2,
)
def _linear(x, w, b=None, transpose_w=False, gelu_input=False):
    """x @ w (+ b) over the last axis as ONE 2-D GEMM; w is (in, out), or (out, in) with transpose_w.

    gelu_input=True computes gelu(x) @ w + b without keeping gelu(x) for backward (the MLP's second
    layer): the largest activation of a transformer block is then never stored.
    """
    w_in = w.shape[1] if transpose_w else w.shape[0]
    if x.shape[-1] != w_in:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight {w.shape} expects {w_in}")
    h = gelu_array(x) if gelu_input else x
    out = gpu_gemm.matmul(_rows(h), w.T if transpose_w else w)
    if b is not None:
        out += b
    return out.reshape(*x.shape[:-1], out.shape[-1]), None


def _linear_add_vjp(
    g,
    _,
    x,
    w,
    b,
    residual,
    gelu_bias=None,
    transpose_w=False,
    gelu_input=False,
    needs=(True,) * 5,
    into=None,
    sums_into=None,
    seed=None,
):
    """The linear's gradients, the residual's (g itself) and the GELU bias's (linear_add's fifth
    input, where given); a seed changes nothing here."""
    into, sums_into = into or (None,) * 5, (sums_into or (None,) * 5)[:3]
    lin_needs = needs[:3] + needs[4:5]
    gx, gw, gb, *g_bias = _linear_vjp(
        g, None, x, w, b, transpose_w, gelu_input, lin_needs, into, sums_into, gelu_bias
    )
    return (gx, gw, gb, g if needs[3] else None, *g_bias)


@primitive(
    "linear_add",
    vjp=_linear_add_vjp,
    takes_needs=True,
    takes_into=True,
    gives_column_sums=True,
    bias_input=_bias_is_input_2,
)
def _linear_add(x, w, b, residual, gelu_bias=None, transpose_w=False, gelu_input=False, seed=None):
    """residual + linear(x, w, b): a block's projection back into its residual stream. On a GPU the
    GEMM accumulates into residual + b where a LayerNorm kernel wrote that into `seed` (a Seed), else
    the bias and the residual are added to its output in one pass; on the CPU the bits of linear,
    then the add. gelu_bias (with gelu_input): the input is gelu(x + gelu_bias), the bias added
    inside the GELU (fused.adds_bias_in_gelu)."""
    h = gelu_array(x, gelu_bias) if gelu_input else x
    seeded = None if seed is None else seed.take(residual, b)
    if seeded is not None:
        gpu_gemm.gemm_into(_rows(h), w.T if transpose_w else w, _rows(seeded), accumulate=True)
        return seeded, None
    out, _ = _linear.forward(h, w, None, transpose_w)
    if out.shape != residual.shape:
        raise ValueError(f"linear_add: the residual {residual.shape} must match the output {out.shape}")
    xp = array_module_of(out)
    if xp is not np and out.flags.c_contiguous and residual.flags.c_contiguous:
        gpu_kernels.add_bias_residual_(out, b, residual)
        return out, None
    out += b
    out += residual  # residual + out: one addition, commutative, so the add primitive's bits
    return out, None


class Seed:
    """linear_add's output begun early, on a GPU: the LayerNorm kernel that opens a block's branch
    reads the residual x anyway, and also writes x + bias (the bias of the projection that closes
    the branch); that projection's GEMM then accumulates into it (cuBLAS's beta = 1), so adding the
    bias and the residual is not a launch of its own. Of the bias only its address is kept; taken,
    the seed is empty again (a forward run again writes it afresh)."""

    def __init__(self, bias):
        self.bias = bias  # the closing linear's bias (a Param): its data is read when the kernel runs
        self._written = None  # (the array, the x it was written from, the bias's address)

    def target(self, x):
        """(an array for x + bias, the bias's array) for a kernel about to read x; None where they
        cannot go together (another width or type)."""
        bias = self.bias.data
        if bias.shape != x.shape[-1:] or bias.dtype != x.dtype:
            return None
        return array_module_of(x).empty_like(x), bias

    def written(self, array, x, bias):
        self._written = (array, x, device_address(bias))

    def take(self, residual, bias):
        """The array written residual + bias (from these very arrays), or None; empty afterwards."""
        written, self._written = self._written, None
        if written is None or written[1] is not residual or written[2] != device_address(bias):
            return None
        return written[0]


def seeds_residuals(xp) -> bool:
    """Whether a block's branch begins its closing projection's output in its LayerNorm kernel (Seed:
    a GPU, a launch less) or adds the bias and the residual after the GEMM (the CPU, whose bits
    stay the add's)."""
    return xp is not np


def adds_bias_in_gelu(xp) -> bool:
    """Whether the MLP adds its first linear's bias inside the GELU (linear_add's gelu_bias: a GPU,
    a launch less) or in that linear (the CPU: the tape keeps x + b there, in place, no temporary)."""
    return xp is not np


# -- LayerNorm ------------------------------------------------------------------------------------


def sum_of_products(xp, a, b, axis: int):
    """(a * b).sum(axis) of 2-D arrays: on the CPU with no (rows, C) temporary (einsum); on a GPU as a
    product and a sum (CuPy's einsum is not measured there)."""
    if xp is not np:
        return (a * b).sum(axis=axis)
    return np.einsum("ij,ij->j" if axis == 0 else "ij,ij->i", a, b)


SUM_GROUP = 1 << 18  # elements of rows whose column sums make one partial sum (sum_group)


def sum_group(xp, rows: int, row_elements: int) -> int:
    """Rows whose column sums (a LayerNorm's weight and bias gradients) make one partial sum, the
    partials then added in row order: fixed by the shape alone, so the number of threads that split
    the rows changes no bit (in deterministic mode neither does the world size, whose ranks have
    other thread counts); all rows on a GPU (one launch)."""
    return max(1, SUM_GROUP // row_elements) if xp is np else rows


def _layer_norm_vjp(g, saved, x, w, b=None, eps=1e-5, into=None, pending=None, sums_into=None):
    """Recomputes xhat from x (kept by the tape anyway) and the saved per-row mean and 1/std. into:
    on a GPU the kernel writes the weight and bias gradients into zeroed parameter gradients; adds
    x's pending gradient (the residual stream's) into its own there (tape.Summed); and writes the
    column sums of x's whole gradient into sums_into[0] where offered (tape.SumsWritten)."""
    mean, rstd = saved
    xp = array_module_of(x)
    x2, g2 = _rows(x), _rows(g)
    n, C = x2.shape
    gx = xp.empty_like(x)
    gx2 = _rows(gx)
    if xp is not np and x.flags.c_contiguous:  # one kernel for the rows, dw and db
        given = (pending or (None,))[0]
        add = given if given is not None and given.shape == x.shape and given.flags.c_contiguous else None
        # x's whole gradient is this one only with the pending one in it
        sums = (sums_into or (None,))[0] if add is not None or given is None else None
        params = _gpu_layer_norm_vjp(xp, g2, x2, w, b, mean, rstd, gx2, into, add, sums)
        if params is not None:
            wrote_sums, params = params
            gx = gx if add is None else Summed(gx)
            gx = SumsWritten(gx) if wrote_sums else gx
            return (gx, params[0]) if b is None else (gx, *params)
    group = sum_group(xp, n, C)
    parts = {}  # per group of rows: partial sums for the weight and bias gradients, added in row order

    def work(i, lo, hi):
        for start in range(lo, hi, group):
            stop = min(start + group, hi)
            gc = g2[start:stop]
            xhat = x2[start:stop] - mean[start:stop]
            xhat *= rstd[start:stop]
            parts[start // group] = (sum_of_products(xp, gc, xhat, axis=0), gc.sum(axis=0))
            gxhat = gc * w  # gx = rstd (gxhat - mean(gxhat) - xhat mean(gxhat xhat))
            projection = sum_of_products(xp, gxhat, xhat, axis=1)[:, None]
            projection *= 1.0 / C
            out = gx2[start:stop]
            xp.subtract(gxhat, gxhat.mean(axis=-1, keepdims=True), out=out)
            xhat *= projection
            out -= xhat
            out *= rstd[start:stop]

    by_rows(xp, n, C, work, align=group)
    gw = sum(parts[k][0] for k in sorted(parts))
    return (gx, gw) if b is None else (gx, gw, sum(parts[k][1] for k in sorted(parts)))


def _gpu_layer_norm_vjp(xp, g2, x2, w, b, mean, rstd, gx2, into, add, sums):
    """(whether `sums` got gx2's column sums, (d w, d b)) from the GPU kernel, which writes gx2 too
    (plus `add`, where given); each WROTE where it went straight into a zeroed parameter gradient
    (`into`); None where it cannot run."""
    params, acc = (w, b), accumulator(w.dtype.type)  # the kernel writes them in its arithmetic's type
    targets = [None if a is None else writable(into, k, a.shape, acc) for k, a in enumerate(params, 1)]
    outs = [t if t is not None or a is None else xp.empty(a.shape, acc) for t, a in zip(targets, params)]
    add2 = None if add is None else _rows(add)
    wrote_sums = gpu_layer_norm.backward(g2, x2, w, mean, rstd, gx2, *outs, add2, sums)
    if wrote_sums is None:
        return None
    own = (
        WROTE if t is not None else None if a is None else out.astype(a.dtype, copy=False)
        for t, out, a in zip(targets, outs, params)
    )
    return wrote_sums, tuple(own)


@primitive("layer_norm", vjp=_layer_norm_vjp, takes_into=True, takes_pending=True, gives_column_sums=True)
def _layer_norm(x, w, b=None, eps=1e-5):
    """Normalize the last axis, then scale and shift; saves only the per-row mean and 1/std."""
    xp = array_module_of(x)
    x2 = _rows(x)
    n, C = x2.shape
    out = xp.empty_like(x)
    o2 = _rows(out)
    mean = xp.empty((n, 1), dtype=x.dtype)
    rstd = xp.empty((n, 1), dtype=x.dtype)
    if xp is not np and x.flags.c_contiguous and gpu_layer_norm.forward(x2, w, b, eps, o2, mean, rstd):
        return out, (mean, rstd)  # (x contiguous: x2 and o2 are views, not copies)

    def work(i, lo, hi):
        o = o2[lo:hi]
        mean[lo:hi] = x2[lo:hi].mean(axis=-1, keepdims=True)
        xp.subtract(x2[lo:hi], mean[lo:hi], out=o)
        rstd[lo:hi, 0] = 1.0 / xp.sqrt(sum_of_products(xp, o, o, axis=1) / C + eps)
        _scale_shift(o, rstd[lo:hi], w, b)

    by_rows(xp, n, C, work)
    return out, (mean, rstd)


def _scale_shift(o, rstd, w, b):
    """o = (x - mean) -> the LayerNorm's output, in place (the forward's and the recompute's passes)."""
    o *= rstd
    o *= w
    if b is not None:
        o += b


def _layer_norm_again(x, mean, rstd, w, b, eps):
    """The LayerNorm's output recomputed from x and its saved statistics: the same passes as the
    forward, so the same bits (the CPU's: a GPU keeps the output, keeps_norm_output)."""
    xp = array_module_of(x)
    out = xp.empty_like(x)
    x2, o2 = _rows(x), _rows(out)

    def work(i, lo, hi):
        xp.subtract(x2[lo:hi], mean[lo:hi], out=o2[lo:hi])
        _scale_shift(o2[lo:hi], rstd[lo:hi], w, b)

    by_rows(xp, *x2.shape, work)
    return out


# -- LayerNorm into a linear ----------------------------------------------------------------------
# A pre-LN block's LayerNorm output feeds one GEMM only. Fused, the tape keeps x (kept anyway: the
# residual stream) and two numbers per row instead of another (B, T, C) array; backward recomputes
# the output in two passes (peer config, N = 2: peak RSS 616 -> 581 MiB per rank, no slower). On a
# GPU the output is kept: a recompute there is a launch (two a block), and launches, not bytes,
# bound the step (issue 30); checkpointed blocks (recompute=) keep nothing of it either way.


def keeps_norm_output(xp) -> bool:
    """Whether layer_norm_linear keeps its LayerNorm's output for backward (a GPU) or recomputes it
    there (the CPU); planning.gpt_activation_bytes counts what this decides."""
    return xp is not np


def _split_ln_linear(arrays, ln_bias: bool, bias: bool):
    """(x, ln_w, ln_b, w, b) from the primitive's inputs; None for an absent bias."""
    x, ln_w, *rest = arrays
    ln_b = rest.pop(0) if ln_bias else None
    return x, ln_w, ln_b, rest[0], rest[1] if bias else None


def _layer_norm_linear_vjp(
    g,
    saved,
    *arrays,
    ln_bias=True,
    bias=True,
    eps=1e-5,
    transpose_w=False,
    needs=None,
    into=None,
    pending=None,
    sums_into=None,
    seed=None,
):
    """The GPU's kept output padded with a ones column (a folded bias): one GEMM writes the weight's
    and the bias's gradients where both go into zeroed gradients side by side (_folded_grads)."""
    x, ln_w, ln_b, w, b = _split_ln_linear(arrays, ln_bias, bias)
    needs = needs or (True,) * len(arrays)
    into = into or (None,) * len(arrays)
    n_ln = 2 + ln_bias
    mean, rstd, *kept = saved
    C = x.shape[-1]
    y = _rows(kept[0])[:, :C] if kept else _layer_norm_again(x, mean, rstd, ln_w, ln_b, eps)
    linear_needs = (any(needs[:n_ln]), *needs[n_ln:])
    lin_into = (None, *into[n_ln:])
    if kept and kept[0].shape[-1] > C and _folded_grads(kept[0], g, lin_into, linear_needs):
        gy, _ = _linear_vjp(g, None, y, w, None, transpose_w, needs=(linear_needs[0], False))
        lin = [WROTE, WROTE]
    else:
        gy, *lin = _linear_vjp(g, None, y, w, b, transpose_w, needs=linear_needs, into=lin_into)
    del y
    if gy is None:
        return (None,) * n_ln + tuple(lin)
    ln = _layer_norm_vjp(gy, (mean, rstd), x, ln_w, ln_b, eps, into[:n_ln], pending, sums_into)
    return (*ln, *lin)


@primitive(
    "layer_norm_linear",
    vjp=_layer_norm_linear_vjp,
    takes_needs=True,
    takes_into=True,
    takes_pending=True,
    gives_column_sums=True,
    bias_input=lambda settings, inputs: inputs - 1 if settings.get("bias", True) else None,
)
def _layer_norm_linear(*arrays, ln_bias=True, bias=True, eps=1e-5, transpose_w=False, seed=None):
    """linear(layer_norm(x)) whose normalized x is kept only where keeps_norm_output says (inputs: x,
    ln_w[, ln_b], w[, b]); on a GPU its LayerNorm kernel also writes seed's x + bias (a Seed)."""
    x, ln_w, ln_b, w, b = _split_ln_linear(arrays, ln_bias, bias)
    xp = array_module_of(x)
    if xp is not np and x.flags.c_contiguous:
        done = _gpu_layer_norm_linear(x, ln_w, ln_b, w, b, eps, transpose_w, seed)
        if done is not None:
            return done
    y, stats = _layer_norm.forward(x, ln_w, ln_b, eps)
    out, _ = _linear.forward(y, w, b, transpose_w)
    return out, (*stats, y) if keeps_norm_output(xp) else stats


def folded_row_length(C: int) -> int:
    """A LayerNorm output's row padded with a ones column: C + 1 elements rounded up to 8 (rows 16
    bytes apart in 16-bit types, as cuBLAS's fastest kernels read them)."""
    return -(-(C + 1) // 8) * 8


def _gpu_layer_norm_linear(x, ln_w, ln_b, w, b, eps, transpose_w, seed):
    """(out, saved) through the LayerNorm kernel, or None where it cannot run. With a bias, it costs
    no launch of its own: the kernel writes it into every row of the GEMM's output, to which the
    GEMM (K = C) adds its product, and pads its own output with a ones column, from which backward
    has the bias's gradient as a GEMM (_folded_grads; K = C + 1 in the forward GEMM ran at a third
    of the speed on an H200: bench/gpu_check.py roofline)."""
    xp, x2 = array_module_of(x), _rows(x)
    n, C = x2.shape
    folded = b is not None and not transpose_w and gpu_gemm.writes(x.dtype, x.dtype)
    padded = xp.empty((n, folded_row_length(C) if folded else C), x.dtype)
    mean, rstd = (xp.empty((n, 1), x.dtype) for _ in range(2))
    seeded, seed_bias = (None if seed is None else seed.target(x)) or (None, None)
    rows_seeded = None if seeded is None else _rows(seeded)
    out = xp.empty((n, w.shape[1]), x.dtype) if folded else None
    biases = (out, b) if folded else (None, None)
    if not gpu_layer_norm.forward(
        x2, ln_w, ln_b, eps, padded, mean, rstd, folded, rows_seeded, seed_bias, *biases
    ):
        return None
    if seeded is not None:
        seed.written(seeded, x, seed_bias)
    if folded:
        gpu_gemm.gemm_into(padded[:, :C], w, out, accumulate=True)
    else:
        out, _ = _linear.forward(padded, w, b, transpose_w)
    return out.reshape(*x.shape[:-1], out.shape[-1]), (mean, rstd, padded)


def _folded_grads(padded, g, into, needs) -> bool:
    """Whether the weight's and the bias's gradients were written from the padded output's ones
    column (the forward folded the bias into its GEMM): dw = y^T g and db = 1^T g, two GEMMs into
    their zeroed gradients (into[1], into[2]); False where they cannot (the GEMM and a column sum
    then run). Not one GEMM of M = C + 1: an odd M ran on an sm80 kernel at half the speed on an
    H200 (3.5 ms of the 370M step's q/k/v weight gradients)."""
    dw, db = into[1:3] if needs[1] and needs[2] else (None, None)
    if dw is None or db is None or not gpu_gemm.writes(padded.dtype, dw.dtype) or db.dtype != dw.dtype:
        return False
    if not (dw.flags.c_contiguous and db.flags.c_contiguous):  # a reshaped copy would take the GEMM
        return False
    C, g2 = dw.shape[0], _rows(g)
    gpu_gemm.gemm_into(padded[:, :C].T, g2, dw)
    gpu_gemm.gemm_into(padded[:, C : C + 1].T, g2, db.reshape(1, -1))
    return True


# -- cross-entropy --------------------------------------------------------------------------------


def _cross_entropy_vjp(g, saved, logits, targets, ignore_index=-1, count=None):
    """Softmax minus one-hot, recomputed from the logits (saves a (N, V) buffer between passes)."""
    lse, valid, count, t = saved
    t = targets.reshape(-1) if t is None else t  # else the device copy of host targets
    xp = array_module_of(logits)
    flat = _rows(logits)
    if valid is None:  # the forward ran the GPU kernel: so does the backward, in one pass
        return (gpu_cross_entropy.backward(flat, t, lse, g, ignore_index, count).reshape(logits.shape),)
    picked = xp.where(valid, t, 0)
    weight = (valid * (g / count)).astype(logits.dtype)[:, None]
    grad = xp.empty_like(flat)

    def work(i, lo, hi):  # in slices of rows: the three passes over a slice stay in cache
        for a, b in row_slices(xp, lo, hi, flat.shape[1]):
            out = grad[a:b]
            xp.subtract(flat[a:b], lse[a:b, None], out=out)
            xp.exp(out, out=out)
            out[xp.arange(b - a), picked[a:b]] -= 1
            out *= weight[a:b]

    by_rows(xp, flat.shape[0], flat.shape[1], work)
    return (grad.reshape(logits.shape),)


def _checked_count(t, valid, classes: int, ignore_index: int, count):
    """The count the loss divides by (default: the valid targets'; 1 where it is 0: all ignored,
    a loss of 0), once the targets are checked in [0, classes). Device targets are checked on the
    device, read with the step's verdict (base/deferred.py), and their count stays there too: no
    host sync in the forward."""
    outside = valid & ((t < 0) | (t >= classes))
    message = lambda: (  # noqa: E731
        f"cross_entropy: target {int(t[outside][0])} is outside [0, {classes}) "
        f"and is not the ignore_index {ignore_index}"
    )
    deferred.check(outside.any(), IndexError, message)
    xp = array_module_of(t)
    if xp is not np:
        count = xp.asarray(valid.sum() if count is None else count, dtype=np.float64)
        return xp.where(count == 0, 1.0, count)
    return (count if count is not None else int(valid.sum())) or 1


@primitive("cross_entropy", vjp=_cross_entropy_vjp)
def _cross_entropy(logits, targets, ignore_index=-1, count=None):
    """Sum over non-ignored positions of -log softmax(logits)[target], divided by `count` (default:
    the number of non-ignored positions, i.e. their mean); numerically stable."""
    xp = array_module_of(logits)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets {targets.shape} must match logits {logits.shape[:-1]}")
    flat = _rows(logits)
    t = targets.reshape(-1)
    if t.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integer class ids, got {targets.dtype}")
    valid = t != ignore_index
    count = _checked_count(t, valid, flat.shape[1], ignore_index, count)
    copied = on_device = None
    if xp is not np and array_module_of(t) is np:  # host targets: checked above with no device read
        t, on_device = gpu_cross_entropy.targets_with_count(xp, t, count)
        copied = t
    if xp is not np and logits.flags.c_contiguous and gpu_cross_entropy.usable(flat, t):  # one kernel
        if on_device is None:  # device targets: their count is on the device too
            on_device = count.reshape(1)
        lse, losses = gpu_cross_entropy.forward(flat, t, ignore_index)
        loss_dtype = np.promote_types(logits.dtype, np.float32)
        loss = xp.divide(losses.sum(), on_device.reshape(()), dtype=loss_dtype)  # as losses.sum() / count
        return loss, (lse, None, on_device, copied)
    if copied is not None:  # the passes below need the mask on the device
        valid = t != ignore_index
    lse = xp.empty(flat.shape[0], dtype=logits.dtype)

    def work(i, lo, hi):  # log-sum-exp per row, in slices: the (rows, vocab) temporary stays small
        for a, b in row_slices(xp, lo, hi, flat.shape[1]):
            peak = flat[a:b].max(axis=1)
            e = flat[a:b] - peak[:, None]
            xp.exp(e, out=e)
            lse[a:b] = peak + xp.log(e.sum(axis=1))

    by_rows(xp, flat.shape[0], flat.shape[1], work)
    picked = flat[xp.arange(flat.shape[0]), xp.where(valid, t, 0)]
    loss = ((lse - picked) * valid).sum() / count
    return xp.asarray(loss, dtype=logits.dtype), (lse, valid, count, copied)
