"""Causal attention on a GPU: ops/causal_attention.py's primitives registered for 'cuda'.

attention_qkv runs as cuDNN's fused SDPA where it runs (sdpa.py: one launch each way, no (T, T)
scores). Otherwise, and for `attention`, the reference's passes with a GPU's differences: every head
at once, the causal softmax and its backward as one kernel each (kernels.py), and blocks of BLOCK
positions past that (each block pair costs a dozen launches and small GEMMs, and memory is
plentiful: GPT-2's whole context is one block).
"""

from __future__ import annotations

import math

from ..autodiff.tensor import implement
from ..base.backend import array_module_of
from ..ops import causal_attention as reference
from ..ops.causal_attention import split_heads, swap_last
from ..ops.fused import whole_arrays
from . import kernels, sdpa

BLOCK = 1024


def _probabilities(q, k, scale):
    """softmax(q k^T * scale + causal mask) on (B, heads, T, T), in place: one kernel."""
    T = q.shape[-2]
    scores = q @ swap_last(k)
    s3 = scores.reshape(-1, T, T)
    if not kernels.causal_softmax_(s3, scale):
        with whole_arrays():
            reference.causal_softmax_(s3, scale)
    return scores


def _whole(q, k, v, scale):
    """The output as a (B, heads, T, hs) view of a (B, T, heads, hs) array (the heads side by side)."""
    B, heads, T, hs = q.shape
    out = array_module_of(q).empty((B, T, heads, hs), dtype=q.dtype).transpose(0, 2, 1, 3)
    out[...] = _probabilities(q, k, scale) @ v
    return out


def _whole_vjp(g, q, k, v, scale, grads):
    """d q, d k, d v into `grads`, the probabilities recomputed from q and k."""
    gq, gk, gv = grads
    T = q.shape[-2]
    att = _probabilities(q, k, scale)
    gv[...] = swap_last(att) @ g
    gs = g @ swap_last(v)  # d att, turned into d scores in place
    gs3, att3 = gs.reshape(-1, T, T), att.reshape(-1, T, T)
    if not kernels.softmax_backward_(gs3, att3, scale):
        with whole_arrays():
            reference.softmax_backward_(gs3, att3, scale)
    gq[...] = gs @ k
    gk[...] = swap_last(gs) @ q


def _attention(q, k, v, scale=None):
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    if q.shape[-2] <= BLOCK:
        return _whole(q, k, v, scale), None
    with whole_arrays():
        return reference.attention_in_blocks(q, k, v, scale, BLOCK)


def _attention_vjp(g, saved, q, k, v, scale=None, grads=None):
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    if saved is not None:  # past BLOCK positions: the reference's blocked passes
        with whole_arrays():
            return reference._attention_vjp_of(g, saved, q, k, v, scale, grads)
    grads = grads or tuple(array_module_of(g).empty(a.shape, dtype=a.dtype) for a in (q, k, v))
    _whole_vjp(g, q, k, v, scale, grads)
    return grads


implement("attention", "cuda", _attention_vjp)(_attention)


def _attention_qkv(qkv, n_head, scale=None):
    B, T, C3 = qkv.shape
    scale = reference.qkv_scale(qkv, n_head, scale)
    graphs = sdpa.graphs_for(qkv, n_head, scale) if qkv.flags.c_contiguous else None
    if graphs is not None:  # cuDNN: one fused launch, no (T, T) scores
        return sdpa.forward(graphs, qkv, n_head)
    y, saved = _attention(*split_heads(qkv, n_head), scale)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C3 // 3), saved


def _attention_qkv_vjp(g, saved, qkv, n_head, scale=None):
    if isinstance(saved, sdpa.Saved):
        return (sdpa.backward(g, saved, qkv),)
    B, T, C = g.shape
    g_heads = g.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)
    gqkv = array_module_of(qkv).empty_like(qkv)
    grads = tuple(split_heads(gqkv, n_head))
    _attention_vjp(g_heads, saved, *split_heads(qkv, n_head), reference.qkv_scale(qkv, n_head, scale), grads)
    return (gqkv,)


implement("attention_qkv", "cuda", _attention_qkv_vjp)(_attention_qkv)
