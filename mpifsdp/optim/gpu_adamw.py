"""AdamW's update of one flat group as one raw GPU kernel: decay, gradient scale and moments at once.

On the CPU, optimizers.adamw_update runs the update slice by slice; on a GPU each pass would be a
launch and a trip through memory. This kernel reads g, p, m, v once and writes them once: the
decoupled decay inside the group's decay segments (a small table on the device, each element tests
it), the LossScaler's unscale and the clip folded into one gradient scale (written back, so the
gradient after the step is the one the update used, as on the CPU), then the bias-corrected moments.
Arithmetic in float32 for float16 and float32 masters (double for float64). Its NumPy twin takes
the same arguments (base/kernels.py TWINS); it checks itself against it once before first use.
"""

from __future__ import annotations

import functools

import numpy as np

from ..base import kernels
from ..base.backend import array_module_of, to_numpy

THREADS, MAX_BLOCKS = 256, 4096

SOURCE = r"""
extern "C" __global__ void adamw_step(ELEM* p, ELEM* g, ELEM* m, ELEM* v, const long long* decay_from,
                                      const long long* decay_to, const int segments, const long long n,
                                      const ACC decay, const ACC grad_scale, const ACC beta1,
                                      const ACC one_minus_beta1, const ACC beta2,
                                      const ACC one_minus_beta2, const ACC lr_over_bias1,
                                      const ACC bias2, const ACC eps) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        ACC gi = (ACC)g[i];
        if (grad_scale != (ACC)1) { gi = (ACC)(ELEM)(gi * grad_scale); g[i] = (ELEM)gi; }
        ACC pi = (ACC)p[i];
        for (int k = 0; k < segments; ++k)
            if (i >= decay_from[k] && i < decay_to[k]) pi = pi * decay;
        const ACC mi = (ACC)m[i] * beta1 + gi * one_minus_beta1;
        const ACC vi = (ACC)v[i] * beta2 + (gi * gi) * one_minus_beta2;
        p[i] = (ELEM)(pi - mi / (sqrt(vi) / bias2 + eps) * lr_over_bias1);
        m[i] = (ELEM)mi;
        v[i] = (ELEM)vi;
    }
}
"""
KERNELS = ("adamw_step",)


def source(dtype) -> str:
    return kernels.typed_source(dtype, SOURCE)


def _twin(grid, block, args, shared_mem=0):
    p, g, m, v, starts, stops, segments, n, decay, scale, b1, omb1, b2, omb2, lrb, bias2, eps = args
    g64 = g.astype(np.float64) * float(scale)
    g[...] = g64
    g64 = g.astype(np.float64)  # the scaled gradient as stored, as the kernel reads it back
    p64 = p.astype(np.float64)
    for start, stop in list(zip(starts, stops))[: int(segments)]:
        p64[int(start) : int(stop)] *= float(decay)
    m64 = m.astype(np.float64) * float(b1) + g64 * float(omb1)
    v64 = v.astype(np.float64) * float(b2) + g64 * g64 * float(omb2)
    p[...] = p64 - m64 / (np.sqrt(v64) / float(bias2) + float(eps)) * float(lrb)
    m[...], v[...] = m64, v64


kernels.TWINS["adamw_step"] = _twin
kernels.RAW_FAMILIES["adamw"] = (source, KERNELS)


@functools.lru_cache(maxsize=1024)
def _segment_arrays(xp, segments: tuple):
    """A group's decay segments on the device (its starts, its stops), copied there once."""
    table = np.array(segments or ((0, 0),), dtype=np.int64).reshape(-1, 2)
    return xp.asarray(table[:, 0].copy()), xp.asarray(table[:, 1].copy())


def _launch(kernel, xp, p, g, m, v, hyper: tuple, decay_segments: tuple):
    starts, stops = _segment_arrays(xp, decay_segments)
    acc = kernels.accumulator(p.dtype.type)
    blocks = max(1, min(MAX_BLOCKS, -(-p.size // THREADS)))
    head = (p, g, m, v, starts, stops, np.int32(len(decay_segments)), np.int64(p.size))
    kernel((blocks,), (THREADS,), (*head, *(acc(h) for h in hyper)))


def step(p, g, m, v, *, decay, grad_scale, beta1, beta2, lr_over_bias1, bias2, eps, decay_segments) -> bool:
    """p, m, v (and g, scaled by grad_scale) updated in place; False where the kernel cannot run (a
    dtype without a kernel, arrays of different dtypes or not contiguous, no NVRTC)."""
    arrays = (p, g, m, v)
    dtype = p.dtype.type
    if dtype not in kernels.ELEMENT_TYPES or not all(
        a.dtype == p.dtype and a.flags.c_contiguous for a in arrays
    ):
        return False
    xp = array_module_of(p)
    compiled = kernels.compiled(xp, source(dtype), KERNELS, "the fused AdamW step")
    if compiled is None:
        return False
    kernels.checked_once(("adamw_step", dtype), lambda: _probe(xp, dtype, compiled[0]))
    hyper = (decay, grad_scale, beta1, 1.0 - beta1, beta2, 1.0 - beta2, lr_over_bias1, bias2, eps)
    _launch(compiled[0], xp, p, g, m, v, hyper, tuple(decay_segments))
    return True


def _probe(xp, dtype, kernel):
    """One step of 3000 elements, two decay segments and a gradient scale, against the twin."""
    rng = np.random.default_rng(13)
    n = 3000
    host = [rng.normal(0, 1, n), rng.normal(0, 1, n), rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)]
    host = [a.astype(dtype) for a in host]
    want = [a.astype(np.float64) for a in host]  # copied before the kernel updates its own inputs
    device = [xp.array(a) for a in host]
    hyper, segments = (0.999, 0.25, 0.9, 0.1, 0.95, 0.05, 1e-3, 0.5, 1e-8), ((10, 700), (2000, 2900))
    _launch(kernel, xp, *device, hyper, segments)
    _twin(None, None, (*want, np.array([10, 2000]), np.array([700, 2900]), 2, n, *hyper))
    names = ("p", "g", "m", "v")
    return [
        (k, to_numpy(d), w, kernels.error_bound(dtype, 16, float(np.max(np.abs(w)))))
        for k, d, w in zip(names, device, want)
    ]
