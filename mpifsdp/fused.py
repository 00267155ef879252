"""The fused transformer primitives: linear (optionally of GELU), GELU, LayerNorm, causal attention,
cross-entropy. Registered like every primitive (forward next to VJP); split from ops.py for size.

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

from .autodiff import primitive
from .backend import array_module_of
from .threads import for_row_blocks

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def _rows(a):
    """A 2-D (rows, last axis) view of a contiguous array."""
    return a.reshape(-1, a.shape[-1])


def _by_rows(xp, n_rows: int, row_elements: int, work) -> int:
    """work(i, lo, hi) over blocks of rows on the CPU; in one piece (i = 0) on a GPU."""
    if xp is np:
        return for_row_blocks(n_rows, row_elements, work)
    work(0, 0, n_rows)
    return 1


# -- GELU (tanh form, as GPT-2) -------------------------------------------------------------------


def _gelu_into(out, x):
    """out = 0.5 x (1 + tanh(c (x + k x^3))), computed in `out` with no temporary."""
    xp = array_module_of(x)
    xp.multiply(x, x, out=out)
    out *= _GELU_K * _GELU_C
    out += _GELU_C
    out *= x
    xp.tanh(out, out=out)
    out += 1
    out *= x
    out *= 0.5


def _gelu_grad_into(out, g, x):
    """out = g * d gelu / dx = g (0.5 (1 + t) + 0.5 x c (1 + 3k x^2)(1 - t^2)), t = tanh(...)."""
    xp = array_module_of(x)
    t = x * x
    t *= _GELU_K * _GELU_C
    t += _GELU_C
    t *= x
    xp.tanh(t, out=t)
    xp.multiply(x, x, out=out)
    out *= 3 * _GELU_K * _GELU_C
    out += _GELU_C
    out *= 1 - t * t
    out *= x
    out += 1
    out += t
    out *= 0.5
    out *= g


def gelu_array(x):
    xp = array_module_of(x)
    out = xp.empty_like(x)
    x2, o2 = _rows(x), _rows(out)
    _by_rows(xp, x2.shape[0], x2.shape[1], lambda i, lo, hi: _gelu_into(o2[lo:hi], x2[lo:hi]))
    return out


def _gelu_grad(g, x):
    xp = array_module_of(x)
    out = xp.empty_like(x)
    x2, g2, o2 = _rows(x), _rows(g), _rows(out)
    _by_rows(xp, x2.shape[0], x2.shape[1], lambda i, lo, hi: _gelu_grad_into(o2[lo:hi], g2[lo:hi], x2[lo:hi]))
    return out


@primitive("gelu", vjp=lambda g, _, x: (_gelu_grad(g, x),))
def _gelu(x):
    """GELU; saves nothing: the VJP recomputes tanh from x, which the tape keeps anyway."""
    return gelu_array(x), None


# -- linear ---------------------------------------------------------------------------------------


def _linear_vjp(g, _, x, w, b=None, transpose_w=False, gelu_input=False):
    h = gelu_array(x) if gelu_input else x  # recomputed: cheaper than keeping (B, T, 4C) around
    g2, h2 = _rows(g), _rows(h)
    gh = (g2 @ w.T if not transpose_w else g2 @ w).reshape(x.shape)
    gw = h2.T @ g2 if not transpose_w else g2.T @ h2
    gx = _gelu_grad(gh, x) if gelu_input else gh
    return (gx, gw) if b is None else (gx, gw, g2.sum(axis=0))


@primitive("linear", vjp=_linear_vjp)
def _linear(x, w, b=None, transpose_w=False, gelu_input=False):
    """x @ w (+ b) over the last axis as ONE 2-D GEMM; w is (in, out), or (out, in) with transpose_w.

    gelu_input=True computes gelu(x) @ w + b without keeping gelu(x) for backward (the MLP's second
    layer): the largest activation of a transformer block is then never stored.
    """
    w_in = w.shape[1] if transpose_w else w.shape[0]
    if x.shape[-1] != w_in:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight {w.shape} expects {w_in}")
    h = gelu_array(x) if gelu_input else x
    out = _rows(h) @ (w.T if transpose_w else w)
    if b is not None:
        out += b
    return out.reshape(*x.shape[:-1], out.shape[-1]), None


# -- LayerNorm ------------------------------------------------------------------------------------


def _layer_norm_vjp(g, saved, x, w, b=None, eps=1e-5):
    """Recomputes xhat from x (kept by the tape anyway) and the saved per-row mean and 1/std."""
    mean, rstd = saved
    xp = array_module_of(x)
    x2, g2 = _rows(x), _rows(g)
    n, C = x2.shape
    gx = xp.empty_like(x)
    gx2 = _rows(gx)
    parts = {}  # per block: partial sums for the weight and bias gradients

    def work(i, lo, hi):
        gc = g2[lo:hi]
        xhat = x2[lo:hi] - mean[lo:hi]
        xhat *= rstd[lo:hi]
        parts[i] = ((gc * xhat).sum(axis=0), gc.sum(axis=0))
        gxhat = gc * w
        out = gx2[lo:hi]
        xp.subtract(gxhat, gxhat.mean(axis=-1, keepdims=True), out=out)
        gxhat *= xhat
        xhat *= gxhat.mean(axis=-1, keepdims=True)
        out -= xhat
        out *= rstd[lo:hi]

    blocks = _by_rows(xp, n, C, work)
    gw = sum(parts[i][0] for i in range(blocks))
    return (gx, gw) if b is None else (gx, gw, sum(parts[i][1] for i in range(blocks)))


@primitive("layer_norm", vjp=_layer_norm_vjp)
def _layer_norm(x, w, b=None, eps=1e-5):
    """Normalize the last axis, then scale and shift; saves only the per-row mean and 1/std."""
    xp = array_module_of(x)
    x2 = _rows(x)
    n, C = x2.shape
    out = xp.empty_like(x)
    o2 = _rows(out)
    mean = xp.empty((n, 1), dtype=x.dtype)
    rstd = xp.empty((n, 1), dtype=x.dtype)

    def work(i, lo, hi):
        o = o2[lo:hi]
        mean[lo:hi] = x2[lo:hi].mean(axis=-1, keepdims=True)
        xp.subtract(x2[lo:hi], mean[lo:hi], out=o)
        rstd[lo:hi] = 1.0 / xp.sqrt((o * o).mean(axis=-1, keepdims=True) + eps)
        o *= rstd[lo:hi]
        o *= w
        if b is not None:
            o += b

    _by_rows(xp, n, C, work)
    return out, (mean, rstd)


# -- causal attention -----------------------------------------------------------------------------


def swap_last(a):
    """The matrix transpose of a stack of matrices (a view)."""
    return a.swapaxes(-1, -2)


def _attention_probabilities(q, k, scale):
    """softmax(q k^T * scale + causal mask) on (B, nh, T, T), built in place block by block."""
    xp = array_module_of(q)
    T = q.shape[-2]
    scores = q @ swap_last(k)
    causal = xp.triu(xp.full((T, T), -xp.inf, dtype=scores.dtype), k=1)  # no looking ahead
    s3 = scores.reshape(-1, T, T)

    def work(i, lo, hi):
        s = s3[lo:hi]
        s *= scale
        s += causal
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)

    _by_rows(xp, s3.shape[0], T * T, work)
    return scores


def _attention_vjp(g, _, q, k, v, scale):
    """Recomputes the probabilities from q and k (one small batched GEMM) instead of keeping them."""
    xp = array_module_of(g)
    att = _attention_probabilities(q, k, scale)
    gv = swap_last(att) @ g
    gs = g @ swap_last(v)  # d att, turned into d scores in place: att * (gatt - rowsum(gatt * att))
    T = att.shape[-1]
    gs3, att3 = gs.reshape(-1, T, T), att.reshape(-1, T, T)

    def work(i, lo, hi):
        d, a = gs3[lo:hi], att3[lo:hi]
        d -= (d * a).sum(axis=-1, keepdims=True)
        d *= a
        d *= scale

    _by_rows(xp, gs3.shape[0], T * T, work)
    return gs @ k, swap_last(gs) @ q, gv


ATTENTION_BLOCK = 256  # queries and keys per block when T is longer: memory O(T * block) per head


def _attention_vjp_of(g, saved, q, k, v, scale=None):
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    if saved is None:  # T <= ATTENTION_BLOCK: one block, probabilities recomputed whole
        return _attention_vjp(g, None, q, k, v, scale)
    return _blocked_attention_vjp(g, saved, q, k, v, scale)


@primitive("attention", vjp=_attention_vjp_of)
def _attention(q, k, v, scale=None):
    """Causal scaled dot-product attention on (B, nh, T, hs). Up to ATTENTION_BLOCK positions it keeps
    nothing beyond q, k, v (backward recomputes the (B, nh, T, T) probabilities, which exist only
    inside this op and its VJP); longer sequences run block by block (flash-style) and keep the
    output and one log-sum-exp per row, so no (T, T) array exists at all."""
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    if q.shape[-2] <= ATTENTION_BLOCK:
        return _attention_probabilities(q, k, scale) @ v, None
    out, lse = _blocked_attention(q, k, v, scale)
    return out, (out, lse)


def _blocks(T: int):
    return [(start, min(start + ATTENTION_BLOCK, T)) for start in range(0, T, ATTENTION_BLOCK)]


def _causal_scores(xp, qb, kb, q0: int, k0: int):
    """qb kb^T (qb already scaled), with keys after their query masked out (diagonal blocks only)."""
    s = qb @ swap_last(kb)
    if k0 + kb.shape[-2] > q0 + 1:
        ahead = xp.arange(k0, k0 + kb.shape[-2])[None, :] > xp.arange(q0, q0 + qb.shape[-2])[:, None]
        s[:, ahead] = -xp.inf
    return s


def _blocked_attention(q, k, v, scale):
    """(out, lse): each query block against the key blocks at or before it, with an online softmax
    (running max m, normaliser l and output, rescaled as each key block arrives)."""
    xp = array_module_of(q)
    T, hs = q.shape[-2:]
    q3, k3, v3 = (a.reshape(-1, T, hs) for a in (q, k, v))
    out, lse = xp.empty_like(q3), xp.empty(q3.shape[:2], dtype=q.dtype)

    def work(i, lo, hi):
        for q0, q1 in _blocks(T):
            qb = q3[lo:hi, q0:q1] * scale
            m = xp.full((hi - lo, q1 - q0, 1), -xp.inf, dtype=q.dtype)
            l = xp.zeros_like(m)
            acc = xp.zeros((hi - lo, q1 - q0, hs), dtype=q.dtype)
            for k0, k1 in _blocks(q1):
                s = _causal_scores(xp, qb, k3[lo:hi, k0:k1], q0, k0)
                m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
                s -= m_new
                xp.exp(s, out=s)
                rescale = xp.exp(m - m_new)
                l = l * rescale + s.sum(axis=-1, keepdims=True)
                acc *= rescale
                acc += s @ v3[lo:hi, k0:k1]
                m = m_new
            out[lo:hi, q0:q1] = acc / l
            lse[lo:hi, q0:q1] = (m + xp.log(l))[..., 0]

    _by_rows(xp, q3.shape[0], T * hs, work)
    return out.reshape(q.shape), lse


def _blocked_attention_vjp(g, saved, q, k, v, scale):
    """Flash-attention's backward: per block pair, p = exp(s - lse) recomputed, then
    dv += p^T g, ds = p (g v^T - rowsum(g o)) scale, dq += ds k, dk += ds^T q."""
    xp = array_module_of(q)
    out, lse = saved
    T, hs = q.shape[-2:]
    q3, k3, v3, g3 = (a.reshape(-1, T, hs) for a in (q, k, v, g))
    delta = (g3 * out.reshape(-1, T, hs)).sum(axis=-1)  # rowsum(g o), (heads, T)
    dq, dk, dv = xp.zeros_like(q3), xp.zeros_like(k3), xp.zeros_like(v3)

    def work(i, lo, hi):
        for q0, q1 in _blocks(T):
            qb, gb = q3[lo:hi, q0:q1], g3[lo:hi, q0:q1]
            qs = qb * scale
            rows = (lse[lo:hi, q0:q1, None], delta[lo:hi, q0:q1, None])
            for k0, k1 in _blocks(q1):
                kb, vb = k3[lo:hi, k0:k1], v3[lo:hi, k0:k1]
                p = _causal_scores(xp, qs, kb, q0, k0)
                p -= rows[0]
                xp.exp(p, out=p)
                dv[lo:hi, k0:k1] += swap_last(p) @ gb
                ds = gb @ swap_last(vb)
                ds -= rows[1]
                ds *= p
                ds *= scale
                dq[lo:hi, q0:q1] += ds @ kb
                dk[lo:hi, k0:k1] += swap_last(ds) @ qb

    _by_rows(xp, q3.shape[0], T * hs, work)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# -- cross-entropy --------------------------------------------------------------------------------


def _cross_entropy_vjp(g, saved, logits, targets, ignore_index=-1, count=None):
    """Softmax minus one-hot, recomputed from the logits (saves a (N, V) buffer between passes)."""
    lse, valid, count = saved
    xp = array_module_of(logits)
    flat = _rows(logits)
    picked = xp.where(valid, targets.reshape(-1), 0)
    weight = (valid * (g / count)).astype(logits.dtype)[:, None]
    grad = xp.empty_like(flat)

    def work(i, lo, hi):
        out = grad[lo:hi]
        xp.subtract(flat[lo:hi], lse[lo:hi, None], out=out)
        xp.exp(out, out=out)
        out[xp.arange(hi - lo), picked[lo:hi]] -= 1
        out *= weight[lo:hi]

    _by_rows(xp, flat.shape[0], flat.shape[1], work)
    return (grad.reshape(logits.shape),)


def _row_slices(lo: int, hi: int, row_elements: int):
    """Sub-ranges of [lo, hi) of about 1 MiB of float32, so a kernel's temporaries stay small."""
    step = max(1, (1 << 18) // max(1, row_elements))
    return ((a, min(a + step, hi)) for a in range(lo, hi, step))


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
    outside = valid & ((t < 0) | (t >= flat.shape[1]))
    if outside.any():
        raise IndexError(
            f"cross_entropy: target {int(t[outside][0])} is outside [0, {flat.shape[1]}) "
            f"and is not the ignore_index {ignore_index}"
        )
    lse = xp.empty(flat.shape[0], dtype=logits.dtype)

    def work(i, lo, hi):  # log-sum-exp per row, in slices: the (rows, vocab) temporary stays small
        for a, b in _row_slices(lo, hi, flat.shape[1]):
            peak = flat[a:b].max(axis=1)
            e = flat[a:b] - peak[:, None]
            xp.exp(e, out=e)
            lse[a:b] = peak + xp.log(e.sum(axis=1))

    _by_rows(xp, flat.shape[0], flat.shape[1], work)
    picked = flat[xp.arange(flat.shape[0]), xp.where(valid, t, 0)]
    count = (count if count is not None else int(valid.sum())) or 1  # all ignored: a loss of 0
    loss = ((lse - picked) * valid).sum() / count
    return xp.asarray(loss, dtype=logits.dtype), (lse, valid, count)
