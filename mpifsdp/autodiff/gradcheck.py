"""Finite-difference checks of VJPs: the inner-product identity <u, J d> = <J^T u, d>.

Public so that users who register their own primitives can check them the same way we do.
Run in float64. The tolerances follow from the method, not from a machine: a central difference with
step h has truncation error ~h^2 |f'''| ~ 1e-12 and rounding error ~eps64 |f| / h ~ 1e-10 (h = 1e-6),
both far below rtol = 1e-6 (check_grad: 1e-5, as a whole-model loss sums many terms), while a wrong
VJP (a missing factor, a transposed term) is off by O(1).
"""

from __future__ import annotations

import numpy as np

from ..base.backend import array_module_of, to_numpy
from .tape import backward
from .tensor import ArrayMeta, implementation


def _inner(a, b) -> float:
    return float(to_numpy((a * b).sum()))


def check_vjp(name: str, arrays, settings=None, *, eps=1e-6, rtol=1e-6, atol=1e-9, seed=0):
    """Check primitive `name`'s VJP at `arrays` against central differences, one input at a time.

    Integer and boolean inputs are skipped (not differentiable). Raises AssertionError with the input
    index, the analytic and the numeric directional derivatives on mismatch.
    """
    settings = settings or {}
    prim = implementation(name, arrays[0])  # the one the arrays' device runs
    rng = np.random.default_rng(seed)
    xp = array_module_of(arrays[0])
    out, saved = prim.forward(*arrays, **settings)
    u = xp.asarray(rng.standard_normal(out.shape))
    # A primitive that declares reads_inputs=False gets what backward gives it: shapes only.
    seen = arrays if prim.reads_inputs else [ArrayMeta(a) for a in arrays]
    grads = prim.vjp(u, saved, *seen, **settings)
    assert len(grads) == len(arrays), f"{name}: VJP returned {len(grads)} grads for {len(arrays)} inputs"
    for i, x in enumerate(arrays):
        if x.dtype.kind != "f":
            continue
        d = xp.asarray(rng.standard_normal(x.shape))

        def f(step, i=i, x=x, d=d):
            moved = list(arrays)
            moved[i] = x + step * d
            return prim.forward(*moved, **settings)[0]

        numeric = _inner(u, (f(eps) - f(-eps)) / (2 * eps))
        analytic = _inner(grads[i], d)
        assert grads[i].shape == x.shape, f"{name}: grad {i} has shape {grads[i].shape}, input {x.shape}"
        assert abs(analytic - numeric) <= atol + rtol * max(abs(numeric), abs(analytic)), (
            f"{name}: input {i}: VJP gives {analytic!r}, central differences {numeric!r}"
        )


def check_grad(loss_fn, params, *, eps=1e-6, rtol=1e-5, atol=1e-9, seed=0):
    """Check backward() of scalar `loss_fn()` w.r.t. Tensors `params` along random directions."""
    rng = np.random.default_rng(seed)
    for p in params:
        p.grad = None
    backward(loss_fn())
    for k, p in enumerate(params):
        xp = array_module_of(p.data)
        d = xp.asarray(rng.standard_normal(p.shape))
        base = p.data.copy()
        values = []
        for step in (eps, -eps):
            p.data = base + step * d
            values.append(float(to_numpy(loss_fn().data)))
        p.data = base
        numeric = (values[0] - values[1]) / (2 * eps)
        analytic = _inner(p.grad, d)
        label = getattr(p, "name", "") or f"#{k}"
        assert abs(analytic - numeric) <= atol + rtol * max(abs(numeric), abs(analytic)), (
            f"parameter {label} {p.shape}: backward gives {analytic!r}, central differences {numeric!r}"
        )


__all__ = ["check_vjp", "check_grad"]
