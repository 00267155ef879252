"""Softmax cross-entropy as raw GPU kernels: one pass over the logits forward, one backward.

The GPT's logits are the step's largest array (B T x vocab; at 8 x 1024 x 32K in float16, 512 MiB).
The array path copied them to float32 (1 GiB), then made seven passes forward and four backward. Here
the forward reads each row of float16 (or float32, float64) logits twice (its max, then the sum of
exponentials about it), in float32 arithmetic (double for float64), and writes one log-sum-exp and
one loss per row; the backward reads the row once more and writes softmax minus one-hot, times the
upstream gradient (read on the device: no host sync) over the valid count, in the logits' dtype.
Each kernel has a NumPy twin taking the same arguments (base/kernels.py TWINS).
"""

from __future__ import annotations

import numpy as np

from ..base import kernels as gk
from ..base.backend import array_module_of, to_numpy

THREADS = 256

SOURCE = gk.cuda_source(__package__, "cross_entropy.cu")
KERNELS = ("cross_entropy_forward", "cross_entropy_backward")


def source(dtype) -> str:
    return gk.typed_source(dtype, SOURCE)


# -- the NumPy twins: the same arguments, float64 arithmetic ---------------------------------------


def _forward_twin(grid, block, args, shared_mem=0):
    logits, targets, lse, loss, V, ignore_index, _packed = args
    rows = logits.reshape(-1, int(V)).astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    lse[...] = (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))[:, 0]
    t = targets.reshape(-1)
    inside = (t >= 0) & (t < int(V))
    picked = rows[np.arange(rows.shape[0]), np.where(inside, t, 0)]
    loss[...] = np.where(t == int(ignore_index), 0.0, np.where(inside, lse - picked, np.nan))


def _backward_twin(grid, block, args, shared_mem=0):
    logits, targets, lse, upstream, grad, V, ignore_index, count, _packed = args
    rows = logits.reshape(-1, int(V)).astype(np.float64)
    t = targets.reshape(-1)
    scale = float(upstream.reshape(-1)[0]) / float(np.ravel(count)[0])
    weight = np.where(t == int(ignore_index), 0.0, scale)
    d = np.exp(rows - lse.reshape(-1, 1).astype(np.float64))
    valid = np.flatnonzero((t >= 0) & (t < int(V)))
    d[valid, t[valid]] -= 1
    grad.reshape(rows.shape)[...] = d * weight[:, None]


FAMILY = gk.family(
    "fused cross-entropy",
    source,
    KERNELS,
    dict(cross_entropy_forward=_forward_twin, cross_entropy_backward=_backward_twin),
)


# -- launching -------------------------------------------------------------------------------------


def _kernels(logits2, targets):
    """The compiled kernels, or None where they cannot run (a dtype without a kernel, non-int64 or
    non-contiguous arrays, no NVRTC): the caller then runs its array passes."""
    dtype = logits2.dtype.type
    usable = (
        dtype in gk.ELEMENT_TYPES
        and targets.dtype == np.int64
        and logits2.flags.c_contiguous
        and targets.flags.c_contiguous
    )
    if not usable:
        return None
    return FAMILY.compiled(array_module_of(logits2), dtype)


def targets_with_count(xp, targets, count: float):
    """(int64 targets, float64 count) on the device from host targets, in one copy: the count (a
    share of the global one, not always whole) rides at the end of the targets' copy, as the int64
    that holds its bits. Both change with the batch, so a captured forward and backward read them
    from device memory (a graph's static inputs), never from a launch's arguments."""
    bits = np.array([count], dtype=np.float64).view(np.int64)
    both = xp.asarray(np.concatenate([targets.astype(np.int64, copy=False), bits]))
    return both[:-1], both[-1:].view(np.float64)


def usable(logits2, targets) -> bool:
    """Whether forward/backward below can run for these arrays."""
    return _kernels(logits2, targets) is not None


def _forward(kernels, xp, logits2, targets, ignore_index: int):
    n, V = logits2.shape
    acc = gk.accumulator(logits2.dtype.type)
    lse, loss = xp.empty(n, dtype=acc), xp.empty(n, dtype=acc)
    sizes = (np.int32(V), np.int64(ignore_index), _packed(logits2))
    kernels[0]((n,), (THREADS,), (logits2, targets, lse, loss, *sizes))
    return lse, loss


def _packed(logits2):
    """The kernels' `packed` argument: rows of whole 16-byte packs, from a 16-byte boundary."""
    return np.int32(gk.in_packs(logits2.dtype, logits2.shape[1:], logits2))


def forward(logits2, targets, ignore_index: int):
    """(lse, loss per row), both in the arithmetic's dtype (float32; float64 for float64 logits), of
    logits2 (rows, V) and int64 targets (rows,)."""
    kernels, xp = _kernels(logits2, targets), array_module_of(logits2)
    key = ("cross_entropy_forward", logits2.dtype.type)
    gk.checked_once(key, lambda: _probe(xp, logits2.dtype))
    return _forward(kernels, xp, logits2, targets, ignore_index)


def _backward(kernels, xp, logits2, targets, lse, upstream, ignore_index: int, count):
    n, V = logits2.shape
    acc = gk.accumulator(logits2.dtype.type)
    grad = xp.empty_like(logits2)
    args = (logits2, targets, lse, xp.asarray(upstream, dtype=acc).reshape(1), grad)
    kernels[1]((n,), (THREADS,), (*args, np.int32(V), np.int64(ignore_index), count, _packed(logits2)))
    return grad


def backward(logits2, targets, lse, upstream, ignore_index: int, count):
    """d loss / d logits2 in logits2's dtype: (softmax - one-hot) * upstream / count on valid rows;
    `upstream` is the loss's gradient, a one-element device array (never read on the host), and
    `count` a one-element float64 device array (targets_with_count)."""
    kernels, xp = _kernels(logits2, targets), array_module_of(logits2)
    key = ("cross_entropy_backward", logits2.dtype.type)
    gk.checked_once(key, lambda: _probe(xp, logits2.dtype, backward=True))
    return _backward(kernels, xp, logits2, targets, lse, upstream, ignore_index, count)


# -- the check at first use --------------------------------------------------------------------------


def _probe(xp, dtype, backward: bool = False):
    """Both kernels on 9 rows of 301 classes (one element at a time) and of 304 (in packs in every
    dtype), one target ignored, against their twins on host copies of the same inputs."""
    return _probe_rows(xp, dtype, backward, 301) + _probe_rows(xp, dtype, backward, 304)


def _probe_rows(xp, dtype, backward: bool, V: int):
    rng = np.random.default_rng(11)
    n = 9
    host_logits = rng.normal(0, 3, (n, V)).astype(dtype)
    host_targets = rng.integers(0, V, n).astype(np.int64)
    host_targets[4] = -1
    logits, targets = xp.asarray(host_logits), xp.asarray(host_targets)
    kernels = _kernels(logits, targets)
    lse, loss = _forward(kernels, xp, logits, targets, -1)
    want = {"lse": np.empty(n), "loss": np.empty(n)}
    _forward_twin(None, None, (host_logits, host_targets, want["lse"], want["loss"], V, -1, 0))
    got = {"lse": lse, "loss": loss}
    if backward:
        upstream = xp.asarray(np.array([0.75], dtype=gk.accumulator(dtype)))
        count = xp.asarray(np.array([7.5]))  # a share of a global count need not be whole
        got["grad"] = _backward(kernels, xp, logits, targets, lse, upstream, -1, count)
        want["grad"] = np.empty((n, V))
        twin = (host_logits, host_targets, to_numpy(lse), np.array([0.75]), want["grad"], V, -1, [7.5], 0)
        _backward_twin(None, None, twin)
    scale = {k: float(np.max(np.abs(v))) for k, v in want.items()}
    bound = {k: gk.error_bound(dtype, 4 * V, scale[k]) for k in want}
    return [(f"{k} of rows of {V}", to_numpy(got[k]), want[k], bound[k]) for k in want]
