"""The fused GPU kernels (mpifsdp/cuda/kernels.py) against their NumPy twins: GELU, its gradient, the two at
once, and the AdamW update. On a machine without a GPU these run the NumPy path against the same
float64 formulas, so they check the reference the GPU kernels are held to."""

import math

import numpy as np
import pytest

from mpifsdp.base.backend import to_numpy
from mpifsdp.ops import fused
from mpifsdp.optim.optimizers import adamw_update

C, K = math.sqrt(2 / math.pi), 0.044715


def _gelu_terms(x):
    """w = 2u, s = sigmoid(w), a = x dw/dx: GELU = x s, its slope = s (1 + a (1 - s))."""
    w = 2 * C * (x + K * x**3)
    with np.errstate(over="ignore"):  # s underflows to 0 only below float64's range
        s = 1 / (1 + np.exp(-w))
    return w, s, 2 * C * x * (1 + 3 * K * x**2)


# Error bounds from the condition of each formula: a few roundings (K_ROUND of them, each <= eps)
# of the result, plus those of the exponent w, which exp turns into a relative error |w| eps of
# exp(-w), i.e. s (1 - s) |w| eps of s. Both paths (NumPy's per-op roundings, a GPU kernel's float32
# arithmetic rounded once) lie inside it; a wrong formula misses by orders of magnitude.
K_ROUND = 8


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_gelu_kernels_match_the_float64_formula(device, xp, dtype):
    rng = np.random.default_rng(0)
    x64 = np.concatenate([rng.normal(0, 3, 1000), [-30.0, -10.0, 0.0, 10.0, 30.0]])
    x64 = x64.astype(dtype).astype(np.float64)  # exactly representable inputs
    g64 = rng.normal(0, 1, x64.size).astype(dtype).astype(np.float64)
    x, g = (xp.asarray(a.astype(dtype)).reshape(5, -1) for a in (x64, g64))
    eps = float(np.finfo(dtype).eps)
    w, s, a = _gelu_terms(x64)
    gelu, grad = x64 * s, g64 * s * (1 + a * (1 - s))
    gelu_bound = K_ROUND * eps * (np.abs(gelu) + np.abs(x64) * s * (1 - s) * np.abs(w))
    grad_bound = K_ROUND * eps * np.abs(g64) * s * (1 + np.abs(a)) * (1 + (1 - s) * np.abs(w))
    tiny = float(np.finfo(dtype).smallest_normal)
    # NumPy's float16 path rounds exp(-w) to float16, which overflows to inf for x below about -3.9
    # (the exponent w itself carrying its rounding): s and the result flush to 0 there, where their
    # true values are below |x| / 65504 and |g x a| / 65504
    with np.errstate(over="ignore"):
        flushed = np.exp(-w + K_ROUND * eps * np.abs(w)) > float(np.finfo(dtype).max)
    gelu_bound[flushed] += np.abs(gelu[flushed])
    grad_bound[flushed] += np.abs(grad[flushed])

    def close(got, want, bound):
        err = np.abs(to_numpy(got).astype(np.float64).reshape(-1) - want)
        assert np.all(err <= bound + tiny), f"worst error / bound: {np.max(err / (bound + tiny)):.3g}"

    gelu_of, grad_of, both_into = _gelu_as_run_on(device)
    with np.errstate(over="ignore"):  # exp(-w) overflows to inf for very negative x: sigmoid 0
        close(gelu_of(x), gelu, gelu_bound)
        close(grad_of(g, x), grad, grad_bound)
        h, gh = xp.empty_like(x), g.copy()
        both_into(h, gh, x)
    close(h, gelu, gelu_bound)
    close(gh, grad, grad_bound)


def _gelu_as_run_on(device: str):
    """(gelu, its gradient, both at once into h and gh) as `device` runs them: the GPU's kernels
    (mpifsdp/cuda/), or the reference's passes in chunks."""
    if device == "cuda":
        from mpifsdp.cuda import fused as gpu_fused
        from mpifsdp.cuda import kernels

        return gpu_fused.gelu_array, gpu_fused._gelu_grad, kernels.gelu_and_grad_into
    return (
        fused.gelu_array,
        fused._gelu_grad,
        lambda h, gh, x: fused._in_chunks(fused._gelu_and_grad_into, h, gh, x),
    )


def test_adamw_update_matches_its_float64_formula(device, xp):
    """The update with decoupled decay on two segments (the GPU's one kernel tests each element
    against the segment table; the CPU decays slice by slice) and a gradient scale."""
    rng = np.random.default_rng(1)
    n, lr, b1, b2, eps, step, wd = 10_000, 1e-3, 0.9, 0.95, 1e-8, 3, 0.1
    segments = [(10, 500), (2000, 2100)]
    p64, g64 = rng.normal(0, 1, n), rng.normal(0, 1, n)
    m64, v64 = rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)
    p, g, m, v = (xp.asarray(a, dtype=np.float32) for a in (p64, g64, m64, v64))
    adamw_update(p, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, step=step, decay_segments=segments,
                 weight_decay=wd, grad_scale=0.5)  # fmt: skip
    p64, g64, m64, v64 = (a.astype(np.float32).astype(np.float64) for a in (p64, g64, m64, v64))
    g64 *= 0.5  # the folded unscale: exact in binary
    np.testing.assert_array_equal(to_numpy(g), g64)  # and written back
    for start, stop in segments:
        p64[start:stop] *= 1 - lr * wd
    m_want = b1 * m64 + (1 - b1) * g64
    v_want = b2 * v64 + (1 - b2) * g64**2
    bias1, bias2 = 1 - b1**step, math.sqrt(1 - b2**step)
    step_want = lr / bias1 * m_want / (np.sqrt(v_want) / bias2 + eps)
    f32 = float(np.finfo(np.float32).eps)
    # each result: a few float32 roundings of terms no larger than the result's own magnitudes
    np.testing.assert_allclose(to_numpy(m), m_want, rtol=0, atol=4 * f32 * (np.abs(m64) + np.abs(g64)).max())
    np.testing.assert_allclose(to_numpy(v), v_want, rtol=0, atol=4 * f32 * (v64 + g64**2).max())
    np.testing.assert_allclose(
        to_numpy(p),
        p64 - step_want,
        rtol=0,
        atol=4 * f32 * np.abs(p64).max() + 8 * f32 * np.abs(step_want).max(),
    )
