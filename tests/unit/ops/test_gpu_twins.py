"""The raw GPU kernels' NumPy twins (kernels.TWINS) against the CPU's own passes (fused.py,
causal_attention.py), in float64: the twins are what the kernels are checked against on a device
(at first use, and in tests/unit/ops/test_gpu_kernels.py), so they must compute the same function.
On a GPU the kernels themselves are compared with the twins."""

import ml_dtypes
import numpy as np
import pytest

from mpifsdp.base import kernels
from mpifsdp.base.backend import to_numpy
from mpifsdp.cuda import cross_entropy as gpu_cross_entropy
from mpifsdp.cuda import kernels as gpu_kernels
from mpifsdp.cuda import layer_norm as gpu_layer_norm
from mpifsdp.ops import fused

# float64 twins against float64 NumPy passes: both are a few roundings of sums over C terms
F64 = float(np.finfo(np.float64).eps)
KERNEL_DTYPES = (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)  # every ELEMENT_TYPES entry


def _close(got, want, terms):
    want = np.asarray(want, np.float64)
    bound = 4 * terms * F64 * float(np.max(np.abs(want)))
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    assert err <= bound, f"error {err:.3g} beyond {bound:.3g}"


@pytest.mark.parametrize("bias", [True, False])
def test_the_layer_norm_twins_compute_fused_layer_norm(bias):
    rng = np.random.default_rng(3)
    n, C = 70, 48  # more rows than the backward's blocks take at once below (rows_per_block 16)
    x, g = rng.normal(1, 2, (n, C)), rng.normal(0, 1, (n, C))
    w, b = rng.normal(1, 0.5, C), rng.normal(0, 0.5, C) if bias else None
    want_out, (mean, rstd) = fused._layer_norm.forward(x, w, b, 1e-5)
    want_grads = fused._layer_norm_vjp(g, (mean, rstd), x, w, b, 1e-5)

    out, m, r = np.empty((n, C)), np.empty((n, 1)), np.empty((n, 1))
    twins = kernels.TWINS
    twins["layer_norm_forward"](
        (n,), None, (x, w, w if b is None else b, out, m, r, x, w, x, w, C, C, 0, 1e-5, int(bias), n)
    )
    for got, want in ((out, want_out), (m, mean), (r, rstd)):
        _close(got, want, C)
    # 2: a ones column after the output, in rows ld apart; 4: the seed x + seed_bias (cuda/fused.py Seed);
    # 8: the next linear's bias in every row of its (n, N) output
    ld, seed_bias, next_bias = C + 8, rng.normal(0, 1, C), rng.normal(0, 1, 3 * C)
    padded, seed, biased = np.full((n, ld), np.nan), np.empty((n, C)), np.empty((n, 3 * C))
    args = (x, w, w if b is None else b, padded, m, r, seed, seed_bias, biased, next_bias)
    twins["layer_norm_forward"]((n,), None, (*args, C, ld, 3 * C, 1e-5, int(bias) | 2 | 4 | 8, n))
    _close(padded[:, :C], want_out, C)
    assert (padded[:, C] == 1).all() and np.isnan(padded[:, C + 1 :]).all()  # the padding unwritten
    _close(seed, x + seed_bias, 1)
    assert (biased == next_bias).all()

    per = 16
    blocks = -(-n // per)
    gx, partial, gw, gb = np.empty((n, C)), np.empty((2, blocks, C)), np.empty(C), np.full(C, np.nan)
    flags = 2 * bias  # 2: has a bias
    twins["layer_norm_backward"](
        (blocks,), None, (g, x, w, m, r, gx, gx, partial, gw, gb, gw, None, n, C, per, flags)
    )
    _close(gx, want_grads[0], C)
    residual = rng.normal(0, 1, (n, C))  # the input's gradient from its other uses, added in the kernel
    gx_and_residual, sums = np.empty((n, C)), np.full(C, np.nan)
    partial = np.empty((3, blocks, C))  # 4: the column sums of what gx holds, into `sums`
    twins["layer_norm_backward"](
        (blocks,),
        None,
        (g, x, w, m, r, gx_and_residual, residual, partial, gw, gb, sums, None, n, C, per, flags | 1 | 4),
    )
    _close(gx_and_residual, want_grads[0] + residual, C)
    _close(sums, (want_grads[0] + residual).sum(axis=0), n * C)
    _close(gw, want_grads[1], n)
    if bias:
        _close(gb, want_grads[2], n)
    else:
        assert np.isnan(gb).all()  # without a bias nothing is written there


@pytest.mark.parametrize("bias", [False, True])
def test_the_gelu_sums_twin_computes_gelu_and_grad_and_the_column_sums(bias):
    """gelu_and_grad_sums's twin: h = gelu(x (+ b)) and gh *= gelu'(x (+ b)) as the CPU's passes
    on x + b, and the column sums of gh (the gradient of that bias, or of the bias of the linear that
    made x), over blocks of 16 rows."""
    rng = np.random.default_rng(6)
    n, C, per = 70, 24, 16
    x, g, b = rng.normal(0, 2, (n, C)), rng.normal(0, 1, (n, C)), rng.normal(0, 1, C)
    want_h, want_g = np.empty((n, C)), g.copy()
    fused._gelu_and_grad_into(want_h, want_g, x + b if bias else x, *(np.empty((n, C)) for _ in range(3)))
    h, gh, sums = np.empty((n, C)), g.copy(), np.full(C, np.nan)
    partial = np.empty((-(-n // per), C))
    kernels.TWINS["gelu_and_grad_sums"](None, None, (x, b, h, gh, partial, sums, None, n, C, per, int(bias)))
    _close(h, want_h, 8)
    _close(gh, want_g, 8)
    _close(sums, want_g.sum(axis=0), 8 * n)


def test_the_gelu_sums_probe_passes_with_the_twin_as_kernel():
    kernel = _as_kernel("gelu_and_grad_sums")
    _probe_passes(lambda dtype: gpu_kernels._gelu_sums_probe(np, dtype, kernel))


def test_the_gelu_bias_rows_twin_computes_gelu_of_x_plus_the_bias():
    """gelu_bias_rows's twin: gelu(x + b) as the CPU's GELU pass on x + b."""
    rng = np.random.default_rng(8)
    n, C = 30, 40
    x, b = rng.normal(0, 2, (n, C)), rng.normal(0, 1, C)
    y = np.full((n, C), np.nan)
    kernels.TWINS["gelu_bias_rows"](None, None, (x, b, y, n, C, 0))
    _close(y, fused.gelu_array(x + b), 8)


def test_the_gelu_bias_rows_probe_passes_with_the_twin_as_kernel():
    kernel = _as_kernel("gelu_bias_rows")
    _probe_passes(lambda dtype: gpu_kernels._gelu_bias_rows_probe(np, dtype, kernel))


def test_the_softmax_twins_compute_the_attention_softmax():
    rng = np.random.default_rng(5)
    heads, T, scale = 3, 16, 0.3
    scores, d = rng.normal(0, 2, (heads, T, T)), rng.normal(0, 1, (heads, T, T))
    p = scores.copy()
    kernels.TWINS["causal_softmax"](None, None, (p, T, scale))
    masked = np.where(np.tri(T, dtype=bool), scores * scale, -np.inf)
    want = np.exp(masked - masked.max(-1, keepdims=True))
    _close(p, want / want.sum(-1, keepdims=True), T)
    gs = d.copy()
    kernels.TWINS["softmax_backward"](None, None, (gs, p, T, scale))
    _close(gs, p * (d - (d * p).sum(-1, keepdims=True)) * scale, T)


def test_the_softmax_probe_passes_with_the_twins_as_kernels():
    twins = tuple(_as_kernel(name) for name in gpu_kernels.ROW_KERNELS)
    _probe_passes(lambda dtype: gpu_kernels._row_probe(np, dtype, twins))


def test_a_wrong_softmax_kernel_is_named_at_its_first_use(monkeypatch):
    """The causal softmax kernels (attention without cuDNN) check themselves against their twins
    before their first real use: a kernel that leaves its rows as they were is named, and the
    scores are not touched."""

    def leaves_rows_alone(grid, block, args, shared_mem=0):
        pass

    monkeypatch.setattr(kernels, "compiled", lambda *a: (leaves_rows_alone, leaves_rows_alone))
    monkeypatch.setattr(kernels, "_checked", set())
    scores = np.random.default_rng(2).normal(0, 1, (2, 8, 8))
    before = scores.copy()
    with pytest.raises(RuntimeError, match=r"causal_softmax \(float64\) computes the probabilities wrong"):
        gpu_kernels.causal_softmax_(scores, 0.5)
    np.testing.assert_array_equal(scores, before)


def test_a_kernel_that_computes_wrong_is_named_before_its_first_use():
    """The check at first use raises on a result beyond its bound, naming the kernel, and remembers
    only kernels that passed."""
    key = ("a wrong kernel", np.float16)

    def wrong():
        return [("out", np.ones(4), np.zeros(4), kernels.error_bound(np.float16, 8, 1.0))]

    with pytest.raises(RuntimeError, match=r"a wrong kernel \(float16\) computes out wrong"):
        kernels.checked_once(key, wrong)
    assert key not in kernels._checked
    good = ("a right kernel", np.float32)
    kernels.checked_once(good, lambda: [("out", np.zeros(3), np.zeros(3), 0.0)])
    assert good in kernels._checked
    kernels._checked.discard(good)


def _as_kernel(name: str):
    """A launcher of kernel `name` that runs its twin: the 'device' is NumPy."""

    def launch(grid, block, args, shared_mem=0):
        kernels.TWINS[name](grid, block, args)

    return launch


def _probe_passes(probe):
    for dtype in KERNEL_DTYPES:
        for what, got, want, bound in probe(np.dtype(dtype)):
            assert np.max(np.abs(to_numpy(got) - want)) <= bound, (dtype, what)


@pytest.mark.parametrize("module", [gpu_layer_norm, gpu_cross_entropy], ids=["layer_norm", "cross_entropy"])
def test_the_probe_passes_with_the_twins_as_kernels(monkeypatch, module):
    """_probe, run where the 'device' is NumPy and the kernels are their twins, finds no error: the
    probe compares like with like (the same arguments, the same layout of the partial sums)."""
    twins = tuple(_as_kernel(name) for name in module.KERNELS)
    monkeypatch.setattr(module, "_kernels", lambda *arrays, **checks: twins)
    _probe_passes(lambda dtype: module._probe(np, dtype, backward=True))


def test_the_cross_entropy_twins_compute_fused_cross_entropy():
    rng = np.random.default_rng(6)
    n, V = 12, 40
    logits, targets = rng.normal(0, 3, (n, V)), rng.integers(0, V, n)
    targets[[2, 7]] = -1  # ignored
    loss, saved = fused._cross_entropy.forward(logits, targets, ignore_index=-1)
    (want_grad,) = fused._cross_entropy_vjp(np.float64(0.5), saved, logits, targets, ignore_index=-1)
    twins = kernels.TWINS
    lse, rows = np.empty(n), np.empty(n)
    twins["cross_entropy_forward"]((n,), None, (logits, targets, lse, rows, V, -1, 0))
    _close(lse, saved[0], V)
    _close(rows.sum() / 10, loss, n * V)  # 10 valid targets
    grad = np.empty((n, V))
    count = np.array([10.0])  # read on the device (float64): it changes with the batch
    twins["cross_entropy_backward"](
        (n,), None, (logits, targets, lse, np.array([0.5]), grad, V, -1, count, 0)
    )
    _close(grad, want_grad, V)
    assert (grad[[2, 7]] == 0).all()


def test_float16_logits_give_a_float32_loss_with_the_bits_of_widening_them_first():
    """ops.cross_entropy widens float16 logits where no kernel reads them as they are (the CPU):
    the GPT no longer widens them itself, and its CPU loss and gradient keep their bits."""
    from mpifsdp.autodiff.tensor import Tensor
    from mpifsdp.ops.loss import cross_entropy

    rng = np.random.default_rng(8)
    data, targets = rng.normal(0, 2, (6, 30)).astype(np.float16), rng.integers(0, 30, 6)
    results = []
    for widen_first in (True, False):
        logits = Tensor(data.copy(), requires_grad=True)
        loss = cross_entropy(logits.astype(np.float32) if widen_first else logits, targets)
        loss.backward()
        results.append((loss.dtype, to_numpy(loss.data).tobytes(), logits.grad.dtype, logits.grad.tobytes()))
    assert results[0] == results[1] and results[0][0] == np.float32 and results[0][2] == np.float16


def test_the_nonfinite_flag_is_set_by_an_inf_and_only_by_one(monkeypatch):
    """flag_nonfinite's launch (grid, arguments) with its twin as the kernel, the first-use check
    included: one flag gathers the verdicts of several arrays."""

    monkeypatch.setattr(kernels, "compiled", lambda *a: (_as_kernel("flag_nonfinite"),))
    monkeypatch.setattr(kernels, "_checked", set())
    flag = np.zeros(1, dtype=np.int32)
    for dtype in KERNEL_DTYPES:
        assert kernels.flag_nonfinite(np.ones(1000, dtype), flag) and flag[0] == 0
    bad = np.ones(3000, np.float16)
    bad[2999] = np.inf  # what a master beyond float16 becomes in the gather
    assert kernels.flag_nonfinite(bad, flag) and flag[0] == 1
    assert kernels.flag_nonfinite(np.ones(10, np.float16), flag) and flag[0] == 1  # stays set
    assert not kernels.flag_nonfinite(np.ones((4, 4), np.float32)[:, ::2], flag)  # not contiguous


def test_a_gathers_cast_sets_the_flag_where_a_master_outgrows_the_type(monkeypatch):
    """cast_flag_nonfinite's launch with its twin as the kernel, the first-use check included: the
    cast of float32 masters is NumPy's (both round to nearest), and a master beyond float16 sets
    the flag to the token, which later casts leave as it is."""
    twins = tuple(_as_kernel(name) for name in kernels.FLAG_KERNELS)
    monkeypatch.setattr(kernels, "compiled", lambda *a: twins)
    monkeypatch.setattr(kernels, "_checked", set())
    masters, flag = np.linspace(-3, 3, 1000, dtype=np.float32), np.zeros(1, dtype=np.int32)
    for dtype in KERNEL_DTYPES:
        out = np.empty(masters.size, dtype)
        assert kernels.cast_flag_nonfinite(masters, out, flag, token=5) and flag[0] == 0
        assert out.tobytes() == masters.astype(dtype).tobytes()
    masters[999] = 1e5
    out = np.empty(masters.size, np.float16)
    assert kernels.cast_flag_nonfinite(masters, out, flag, token=5) and flag[0] == 5
    masters[999] = 1.0
    assert kernels.cast_flag_nonfinite(masters, out, flag, token=6) and flag[0] == 5  # stays
    assert not kernels.cast_flag_nonfinite(masters.astype(np.float64), out, flag)  # float32 masters only


def test_the_adamw_twin_computes_adamw_update_with_its_gradient_scale():
    """cuda/adamw.py's twin against the CPU's adamw_update (decay segments, a folded unscale and
    clip written back into the gradient), float64."""
    from mpifsdp.cuda import adamw as gpu_adamw
    from mpifsdp.optim.optimizers import adamw_update

    rng = np.random.default_rng(9)
    n, lr, b1, b2, eps, step, wd, scale = 5000, 1e-2, 0.9, 0.95, 1e-8, 4, 0.1, 0.37
    segments = ((5, 900), (3000, 4100))
    p, g, m, v = rng.normal(0, 1, n), rng.normal(0, 1, n), rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)
    want = [a.copy() for a in (p, g, m, v)]
    adamw_update(*want, lr=lr, beta1=b1, beta2=b2, eps=eps, step=step, decay_segments=segments,
                 weight_decay=wd, grad_scale=scale)  # fmt: skip
    bias1, bias2 = 1 - b1**step, np.sqrt(1 - b2**step)
    got = [a.copy() for a in (p, g, m, v)]
    hyper = (1 - lr * wd, scale, b1, 1 - b1, b2, 1 - b2, lr / bias1, bias2, eps)
    kernels.TWINS["adamw_step"](None, None, (*got, np.array([5, 3000]), np.array([900, 4100]), 2, n, *hyper))
    for name, a, b in zip("pgmv", got, want):
        _close(a, b, 8), name
    assert gpu_adamw.KERNELS == ("adamw_step", "adamw_groups")


def test_the_adamw_probe_passes_with_the_twin_as_kernel():
    from mpifsdp.cuda import adamw as gpu_adamw

    _probe_passes(lambda dtype: gpu_adamw._probe(np, dtype, _as_kernel("adamw_step")))


def test_every_groups_adamw_step_in_one_launch_is_each_groups_step():
    """adamw_groups (every group's update in one launch, from a table of addresses, lengths, decay
    segments and hyperparameters) as its first-use probe sees it, with its twin as the kernel:
    each group's p, g, m and v as adamw_step's twin leaves them (two groups, one of several pieces
    and two decay segments, one shorter than a piece and none)."""
    from mpifsdp.cuda import adamw as gpu_adamw

    _probe_passes(lambda dtype: gpu_adamw._probe_groups(np, dtype, _as_kernel("adamw_groups")))


@pytest.mark.parametrize(
    "cast", [np.float16, ml_dtypes.bfloat16, np.float32], ids=["float16", "bfloat16", "float32"]
)
def test_adamw_groups_casts_the_updated_masters_and_flags_an_overflow(cast):
    """adamw_groups with a cast (the next gather's param_dtype, written as it updates float32
    masters), as its probe sees it with the twin as kernel: the cast is the updated masters' within
    a rounding, and the flag holds the token where a master beyond float16 overflowed it only."""
    from mpifsdp.cuda import adamw as gpu_adamw

    results = gpu_adamw._probe_groups(np, np.float32, _as_kernel("adamw_groups"), np.dtype(cast))
    for what, got, want, bound in results:
        assert np.max(np.abs(to_numpy(got) - want)) <= bound, what
    (flag,) = [want for what, _, want, _ in results if what == "its flag"]
    assert flag[0] == (5 if cast is np.float16 else 0)


def test_the_sum_of_squares_twins_compute_every_vectors_sum_of_squares():
    """cuda/norm.py's two twins (pieces of each vector, then each vector's pieces added) on
    vectors of unequal lengths, one spanning several pieces, against float64 dots; and its probe."""
    from mpifsdp.cuda import norm as gpu_norm

    rng = np.random.default_rng(12)
    vectors = [rng.normal(0, 1, n) for n in (2 * gpu_norm.PIECE + 3, 1, gpu_norm.PIECE - 1)]
    got = gpu_norm._launch(tuple(_as_kernel(name) for name in gpu_norm.KERNELS), np, vectors)
    for total, v in zip(got, vectors):
        _close(total, v @ v, v.size)
    _probe_passes(lambda dtype: gpu_norm._probe(np, dtype, tuple(_as_kernel(n) for n in gpu_norm.KERNELS)))
