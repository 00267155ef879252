"""Causal scaled dot-product attention as one primitive, its probabilities never kept for backward.

Up to ATTENTION_BLOCK positions the (B, nh, T, T) probabilities are built whole inside the op and
recomputed in its VJP; longer sequences run block by block with an online softmax (flash-style), so
no (T, T) array exists and memory grows with T, not T². Both split their heads across this rank's
threads (fused.by_rows), each block running its GEMMs with BLAS on one thread, and their softmax
passes run over cache-sized pieces. The reference implementation; a GPU runs its own
(mpifsdp/cuda/attention.py: cuDNN's fused attention, else these passes with its softmax kernels).
"""

from __future__ import annotations

import math

from ..autodiff.tensor import primitive
from ..base.backend import array_module_of
from .fused import by_rows, row_slices


def swap_last(a):
    """The matrix transpose of a stack of matrices (a view)."""
    return a.swapaxes(-1, -2)


def causal_softmax_(s3, scale):
    """s3 (heads, T, T) <- softmax(s3 * scale + causal mask), in place."""
    xp, T = array_module_of(s3), s3.shape[-1]
    causal = xp.triu(xp.full((T, T), -xp.inf, dtype=s3.dtype), k=1)  # no looking ahead
    for a, b in row_slices(0, s3.shape[0], T * T):
        s = s3[a:b]
        s *= scale
        s += causal
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)


def softmax_backward_(gs3, att3, scale):
    """gs3 (heads, T, T): d probabilities <- d scores = att (gatt - rowsum(gatt att)) scale, in place."""
    for a, b in row_slices(0, gs3.shape[0], gs3.shape[-1] ** 2):
        d, p = gs3[a:b], att3[a:b]
        d -= (d * p).sum(axis=-1, keepdims=True)
        d *= p
        d *= scale


def _probabilities(q, k, scale):
    """softmax(q k^T * scale + causal mask) on (B, heads, T, T), built in place."""
    T = q.shape[-2]
    scores = q @ swap_last(k)
    causal_softmax_(scores.reshape(-1, T, T), scale)
    return scores


def _by_heads(q, work):
    """work(i, lo, hi) over blocks of heads (axis 1 of (B, heads, T, hs)), in parallel on the CPU with
    BLAS on one thread per block: one head's GEMMs (T x hs) are too small for BLAS's own threads to
    pay, and the softmax passes between them then run in parallel too."""
    B, heads, T = q.shape[:3]
    by_rows(heads, B * T * T, work, calls_blas=True)


def _whole_attention(q, k, v, scale):
    """The output as a (B, heads, T, hs) view of a (B, T, heads, hs) array: the heads side by side, as
    attention_qkv returns them, with no copy."""
    xp = array_module_of(q)
    B, heads, T, hs = q.shape
    out = xp.empty((B, T, heads, hs), dtype=q.dtype).transpose(0, 2, 1, 3)

    def work(i, lo, hi):
        h = slice(lo, hi)
        xp.matmul(_probabilities(q[:, h], k[:, h], scale), v[:, h], out=out[:, h])  # written in place

    _by_heads(q, work)
    return out


def _attention_vjp(g, q, k, v, scale, grads):
    """Recomputes the probabilities from q and k (one small batched GEMM) instead of keeping them;
    writes d q, d k, d v into `grads`."""
    xp = array_module_of(g)
    gq, gk, gv = grads
    T = q.shape[-2]

    def work(i, lo, hi):
        h = slice(lo, hi)
        att = _probabilities(q[:, h], k[:, h], scale)
        xp.matmul(swap_last(att), g[:, h], out=gv[:, h])
        gs = g[:, h] @ swap_last(v[:, h])  # d att, turned into d scores in place
        softmax_backward_(gs.reshape(-1, T, T), att.reshape(-1, T, T), scale)
        xp.matmul(gs, k[:, h], out=gq[:, h])
        xp.matmul(swap_last(gs), q[:, h], out=gk[:, h])

    _by_heads(q, work)


ATTENTION_BLOCK = 256  # queries and keys per block when T is longer: memory O(T * block) per head


def _attention_vjp_of(g, saved, q, k, v, scale=None, grads=None):
    """(d q, d k, d v), written into `grads` where given (three arrays of q's shape)."""
    xp = array_module_of(g)
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    if saved is not None:  # past the block: the blocked path's own arrays, copied where asked
        blocked = _blocked_attention_vjp(g, saved, q, k, v, scale)
        for grad, value in zip(grads or (), blocked):
            grad[...] = value
        return grads or blocked
    grads = grads or tuple(xp.empty(a.shape, dtype=a.dtype) for a in (q, k, v))
    _attention_vjp(g, q, k, v, scale, grads)  # one block, probabilities recomputed whole
    return grads


def attention_in_blocks(q, k, v, scale, block: int):
    """Causal scaled dot-product attention on (B, nh, T, hs). Up to `block` positions it keeps
    nothing beyond q, k, v (backward recomputes the (B, nh, T, T) probabilities, which exist only
    inside this op and its VJP); longer sequences run block by block (flash-style) and keep the
    output, one log-sum-exp per row and the block size, so no (T, T) array exists at all."""
    if q.shape[-2] <= block:
        return _whole_attention(q, k, v, scale), None
    out, lse = _blocked_attention(q, k, v, scale, block)
    return out, (out, lse, block)


def _causal_attention(q, k, v, scale=None):
    """attention_in_blocks of ATTENTION_BLOCK positions."""
    return attention_in_blocks(q, k, v, scale or 1.0 / math.sqrt(q.shape[-1]), ATTENTION_BLOCK)


primitive("attention", vjp=_attention_vjp_of)(_causal_attention)


def split_heads(qkv, n_head: int):
    """q, k, v as (B, nh, T, hs) views of the fused projection (B, T, 3C): no copy."""
    B, T, C3 = qkv.shape
    return qkv.reshape(B, T, 3, n_head, C3 // (3 * n_head)).transpose(2, 0, 3, 1, 4)


def _attention_qkv_vjp(g, saved, qkv, n_head, scale=None):
    """The three head gradients written into one (B, T, 3C) array (no zero-filled slices to sum)."""
    xp = array_module_of(qkv)
    B, T, C = g.shape
    g_heads = g.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)
    gqkv = xp.empty_like(qkv)
    _attention_vjp_of(
        g_heads, saved, *split_heads(qkv, n_head), scale, grads=tuple(split_heads(gqkv, n_head))
    )
    return (gqkv,)


def qkv_scale(qkv, n_head: int, scale):
    """The scale (default 1/sqrt(head size)), once the projection is checked to split into heads."""
    C3 = qkv.shape[-1]
    if C3 % (3 * n_head):
        raise ValueError(f"attention_qkv: {C3} features are not 3 x {n_head} heads of equal size")
    return scale or 1.0 / math.sqrt(C3 // (3 * n_head))


@primitive("attention_qkv", vjp=_attention_qkv_vjp)
def _attention_qkv(qkv, n_head, scale=None):
    """Causal attention from the fused q/k/v projection (B, T, 3C) to the heads' outputs side by side
    (B, T, C). The heads are views of the projection, so no slicing, reshape or transpose of q, k and
    v is recorded, and backward returns one (B, T, 3C) gradient."""
    B, T, C3 = qkv.shape
    scale = qkv_scale(qkv, n_head, scale)
    y, saved = _causal_attention(*split_heads(qkv, n_head), scale)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C3 // 3), saved


def _blocks(T: int, block: int):
    return [(start, min(start + block, T)) for start in range(0, T, block)]


def _causal_scores(xp, qb, kb, q0: int, k0: int):
    """qb kb^T (qb already scaled), with keys after their query masked out (diagonal blocks only)."""
    s = qb @ swap_last(kb)
    if k0 + kb.shape[-2] > q0 + 1:
        ahead = xp.arange(k0, k0 + kb.shape[-2])[None, :] > xp.arange(q0, q0 + qb.shape[-2])[:, None]
        s[:, ahead] = -xp.inf
    return s


def _blocked_attention(q, k, v, scale, block):
    """(out, lse): each query block against the key blocks at or before it, with an online softmax
    (running max m, normaliser l and output, rescaled as each key block arrives)."""
    xp = array_module_of(q)
    T, hs = q.shape[-2:]
    q3, k3, v3 = (a.reshape(-1, T, hs) for a in (q, k, v))
    out, lse = xp.empty_like(q3), xp.empty(q3.shape[:2], dtype=q.dtype)

    def work(i, lo, hi):
        for q0, q1 in _blocks(T, block):
            qb = q3[lo:hi, q0:q1] * scale
            m = xp.full((hi - lo, q1 - q0, 1), -xp.inf, dtype=q.dtype)
            l = xp.zeros_like(m)
            acc = xp.zeros((hi - lo, q1 - q0, hs), dtype=q.dtype)
            for k0, k1 in _blocks(q1, block):
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

    by_rows(q3.shape[0], T * hs, work, calls_blas=True)
    return out.reshape(q.shape), lse


def _blocked_attention_vjp(g, saved, q, k, v, scale):
    """Flash-attention's backward: per block pair, p = exp(s - lse) recomputed, then
    dv += p^T g, ds = p (g v^T - rowsum(g o)) scale, dq += ds k, dk += ds^T q."""
    xp = array_module_of(q)
    out, lse, block = saved
    T, hs = q.shape[-2:]
    q3, k3, v3, g3 = (a.reshape(-1, T, hs) for a in (q, k, v, g))
    delta = (g3 * out.reshape(-1, T, hs)).sum(axis=-1)  # rowsum(g o), (heads, T)
    dq, dk, dv = xp.zeros_like(q3), xp.zeros_like(k3), xp.zeros_like(v3)

    def work(i, lo, hi):
        for q0, q1 in _blocks(T, block):
            qb, gb = q3[lo:hi, q0:q1], g3[lo:hi, q0:q1]
            qs = qb * scale
            rows = (lse[lo:hi, q0:q1, None], delta[lo:hi, q0:q1, None])
            for k0, k1 in _blocks(q1, block):
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

    by_rows(q3.shape[0], T * hs, work, calls_blas=True)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
