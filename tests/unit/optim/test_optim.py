"""AdamW against a textbook per-parameter implementation; clipping; zero_grad."""

import numpy as np
import pytest

from mpifsdp import Param
from mpifsdp.optim.optimizers import SGD, Adam, AdamW


def reference_adamw(params, grads_per_step, lr, betas, eps, wd, decays=lambda p: p.ndim >= 2):
    """Loshchilov & Hutter AdamW as PyTorch writes it, decay on the tensors `decays` picks."""
    b1, b2 = betas
    p = [x.copy() for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            if decays(p[i]):
                p[i] = p[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g**2
            mhat, vhat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            p[i] = p[i] - lr * mhat / (np.sqrt(vhat) + eps)
    return p, m, v


def test_adamw_matches_reference(rng):
    init = [rng.standard_normal((4, 3)), rng.standard_normal(3), rng.standard_normal((2, 2, 2))]
    grads = [[rng.standard_normal(x.shape) for x in init] for _ in range(5)]
    params = [Param(x.copy(), f"p{i}") for i, x in enumerate(init)]
    opt = AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay="matrices")
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.copy()
        opt.step()
        opt.zero_grad()
    want_p, want_m, want_v = reference_adamw(init, grads, 0.01, (0.9, 0.95), 1e-8, 0.1)
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.data, want_p[i], rtol=1e-13, atol=1e-15)
        state = opt.state_of(p)
        np.testing.assert_allclose(state["exp_avg"].reshape(p.shape), want_m[i], rtol=1e-13)
        np.testing.assert_allclose(state["exp_avg_sq"].reshape(p.shape), want_v[i], rtol=1e-13)
        assert p.grad is None


def test_decay_segments_that_cross_slices_and_thread_blocks(rng):
    """The decay is applied slice by slice as each slice is updated (optim.SLICE elements, split over
    threads): exactly inside the segments, whatever slice or block boundary they straddle."""
    from mpifsdp.base.threads import row_blocks, set_elementwise_threads
    from mpifsdp.optim import optimizers as optim

    n = 8 * optim.SLICE + 1234  # two thread blocks, the second not starting on a slice boundary
    segments = [(100, optim.SLICE + 7), (2 * optim.SLICE - 3, 2 * optim.SLICE + 5), (n // 2 - 5, n // 2 + 5)]
    segments.append((n - 10, n))
    p0, g, m0 = rng.standard_normal(n), rng.standard_normal(n), rng.standard_normal(n)
    v0 = rng.random(n)
    lr, wd, b1, b2, eps, step = 0.01, 0.1, 0.9, 0.95, 1e-8, 3
    inside = np.zeros(n, dtype=bool)
    for start, stop in segments:
        inside[start:stop] = True
    m = b1 * m0 + (1 - b1) * g  # the same operations in the same order: bit-identical
    v = b2 * v0 + (1 - b2) * (g * g)
    denom = np.sqrt(v) / np.sqrt(1 - b2**step) + eps
    want = np.where(inside, p0 * (1 - lr * wd), p0) - (m / denom) * (lr / (1 - b1**step))
    for threads in (1, 2):
        set_elementwise_threads(threads)
        assert len(row_blocks(n, 1)) == threads
        p, mm, vv = p0.copy(), m0.copy(), v0.copy()
        optim.adamw_update(p, g, mm, vv, lr=lr, beta1=b1, beta2=b2, eps=eps, step=step,
                           decay_segments=segments, weight_decay=wd)  # fmt: skip
        np.testing.assert_array_equal(p, want, err_msg=f"{threads} threads")
    set_elementwise_threads(1)


def test_params_without_grad_are_left_alone(rng):
    a, b = Param(rng.standard_normal(3), "a"), Param(rng.standard_normal(3), "b")
    before = b.data.copy()
    a.grad = np.ones(3)
    AdamW([a, b], lr=0.1).step()
    np.testing.assert_array_equal(b.data, before)


def test_clip_grad_norm_scales_to_max(rng):
    a, b = Param(np.zeros(3), "a"), Param(np.zeros((2, 2)), "b")
    a.grad, b.grad = np.array([3.0, 0.0, 0.0]), np.array([[0.0, 4.0], [0.0, 0.0]])
    opt = AdamW([a, b])
    assert opt.clip_grad_norm(1.0) == pytest.approx(5.0)
    assert opt.grad_norm() == pytest.approx(1.0, rel=1e-6)
    assert opt.clip_grad_norm(10.0) == pytest.approx(1.0, rel=1e-6)  # below the max: unchanged
    assert a.grad[0] == pytest.approx(0.6, rel=1e-6)


def test_empty_optimizer_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        AdamW([])


def test_each_group_counts_its_own_steps(rng):
    """A parameter first stepped at step 3 gets the bias corrections of its own first step (as
    PyTorch): m_hat = g and v_hat = g^2, so it moves by lr * g / (|g| + eps) after its decay."""
    lr, wd, eps = 0.01, 0.1, 1e-8
    a, b = Param(rng.standard_normal(3), "a"), Param(rng.standard_normal((2, 2)), "b")
    opt = AdamW([a, b], lr=lr, eps=eps, weight_decay=wd)
    b0, g = b.data.copy(), rng.standard_normal((2, 2))
    for step in range(3):
        a.grad = rng.standard_normal(3)
        if step == 2:
            b.grad = g.copy()
        opt.step()
        opt.zero_grad()
    np.testing.assert_allclose(b.data, b0 * (1 - lr * wd) - lr * g / (np.abs(g) + eps), rtol=1e-14)
    assert opt.summary()["group_steps"] == {"a": 3, "b": 1} and opt.step_count == 3


def test_defaults_are_torchs_and_decay_filters_work(rng):
    """AdamW() = torch.optim.AdamW(): betas (0.9, 0.999), eps 1e-8, decay 0.01 on every tensor."""
    init = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal(x.shape) for x in init] for _ in range(3)]
    for decay, decays in [
        ("all", lambda p: True),
        ("matrices", lambda p: p.ndim >= 2),
        (lambda name, shape: name == "bias", lambda p: p.ndim == 1),
    ]:
        params = [Param(init[0].copy(), "weight"), Param(init[1].copy(), "bias")]
        opt = AdamW(params, decay=decay)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.copy()
            opt.step()
        want = reference_adamw(init, grads, 1e-3, (0.9, 0.999), 1e-8, 0.01, decays)[0]
        for p, w in zip(params, want):
            np.testing.assert_allclose(p.data, w, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="decay must be 'all', 'matrices' or a function"):
        AdamW(params, decay="vectors")


def _sgd_reference(init, grads, lr, momentum, nesterov, wd):
    p, buf = [x.copy() for x in init], [None] * len(init)
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            g = g + wd * p[i]
            buf[i] = g.copy() if buf[i] is None else momentum * buf[i] + g
            p[i] = p[i] - lr * (g + momentum * buf[i] if nesterov else buf[i])
    return p


def _adam_reference(init, grads, lr, betas, eps, wd):
    b1, b2 = betas
    p, m, v = [x.copy() for x in init], [np.zeros_like(x) for x in init], [np.zeros_like(x) for x in init]
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            g = g + wd * p[i]  # coupled L2
            m[i], v[i] = b1 * m[i] + (1 - b1) * g, b2 * v[i] + (1 - b2) * g**2
            p[i] = p[i] - lr * (m[i] / (1 - b1**t)) / (np.sqrt(v[i] / (1 - b2**t)) + eps)
    return p


@pytest.mark.parametrize(
    "make, reference",
    [
        (lambda ps: SGD(ps, lr=0.1), lambda i, g: _sgd_reference(i, g, 0.1, 0.0, False, 0.0)),
        (
            lambda ps: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda i, g: _sgd_reference(i, g, 0.1, 0.9, False, 0.01),
        ),
        (
            lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
            lambda i, g: _sgd_reference(i, g, 0.1, 0.9, True, 0.0),
        ),
        (
            lambda ps: Adam(ps, lr=0.01, weight_decay=0.1),
            lambda i, g: _adam_reference(i, g, 0.01, (0.9, 0.999), 1e-8, 0.1),
        ),
    ],
    ids=["sgd", "sgd-momentum-decay", "sgd-nesterov", "adam-l2"],
)
def test_sgd_and_adam_match_torchs_update_rules(rng, make, reference):
    init = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal(x.shape) for x in init] for _ in range(4)]
    params = [Param(x.copy(), f"p{i}") for i, x in enumerate(init)]
    opt = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.copy()
        opt.step()
        opt.zero_grad()
    for p, want in zip(params, reference(init, grads)):
        np.testing.assert_allclose(p.data, want, rtol=1e-13, atol=1e-15)


def test_sgd_settings_are_validated():
    with pytest.raises(
        ValueError, match=r"SGD: invalid momentum=1.5, nesterov=True needs momentum > 0|momentum=1.5"
    ):
        SGD([Param(np.ones(2), "a")], momentum=1.5)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        SGD([Param(np.ones(2), "a")], nesterov=True)
