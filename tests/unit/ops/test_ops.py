"""Every registered primitive's VJP against central differences (float64), on every backend."""

import math

import numpy as np
import pytest

import mpifsdp
from mpifsdp.extend import PRIMITIVES, check_vjp
from mpifsdp.ops.primitives import unbroadcast


def _r(*shape, seed=0, positive=False):
    a = np.random.default_rng(seed + 17 * len(shape) + sum(shape)).standard_normal(shape)
    return np.abs(a) + 0.5 if positive else a


def _distinct(*shape):
    """Values far apart so max has no near-ties within the finite-difference step."""
    return np.random.default_rng(5).permutation(math.prod(shape)).reshape(shape) * 0.1


# name -> list of (arrays, settings); shapes include broadcasting and odd sizes.
CASES = {
    "add": [((_r(3, 4), _r(4)), {}), ((_r(2, 1, 3), _r(5, 1)), {})],
    "sub": [((_r(3, 4), _r(3, 1)), {}), ((_r(1), _r(2, 3)), {})],
    "mul": [((_r(3, 4), _r(4)), {}), ((_r(2, 3, 1), _r(1, 4)), {})],
    "div": [((_r(3, 4), _r(4, positive=True)), {}), ((_r(3, 1), _r(2, 3, 5, positive=True)), {})],
    "neg": [((_r(3, 4),), {})],
    "pow": [((_r(3, 4, positive=True),), {"exponent": 2.5}), ((_r(5),), {"exponent": 3.0})],
    "exp": [((_r(3, 4),), {})],
    "log": [((_r(3, 4, positive=True),), {})],
    "tanh": [((_r(3, 4),), {})],
    "sqrt": [((_r(3, 4, positive=True),), {})],
    "relu": [((_r(7, 5) + 0.05,), {})],
    "gelu": [((_r(3, 7) * 2,), {})],
    "matmul": [
        ((_r(3, 4), _r(4, 5)), {}),
        ((_r(2, 3, 4), _r(4, 2)), {}),
        ((_r(2, 1, 3, 4), _r(5, 4, 2)), {}),
    ],
    "linear": [
        ((_r(2, 3, 4), _r(4, 5)), {}),
        ((_r(2, 3, 4), _r(4, 5), _r(5)), {}),
        ((_r(6, 4), _r(5, 4)), {"transpose_w": True}),
        ((_r(2, 3, 4), _r(4, 5), _r(5)), {"gelu_input": True}),
    ],
    "linear_add": [
        ((_r(2, 3, 4), _r(4, 5), _r(5), _r(2, 3, 5)), {}),
        ((_r(2, 3, 4), _r(4, 5), _r(5), _r(2, 3, 5)), {"gelu_input": True}),
        ((_r(2, 3, 4), _r(4, 5), _r(5), _r(2, 3, 5), _r(4)), {"gelu_input": True}),  # gelu(x + bias)
    ],
    "sum": [
        ((_r(3, 4, 5),), {"axis": None}),
        ((_r(3, 4, 5),), {"axis": 1}),
        ((_r(3, 4),), {"axis": (0, 1), "keepdims": True}),
    ],
    "mean": [((_r(3, 4, 5),), {"axis": -1}), ((_r(3, 4),), {"axis": None, "keepdims": True})],
    "max": [((_distinct(3, 4, 5),), {"axis": 1}), ((_distinct(4, 3),), {"axis": None})],
    "reshape": [((_r(3, 4),), {"shape": (2, 6)})],
    "astype": [((_r(3, 4),), {"dtype": np.float64})],
    "transpose": [((_r(2, 3, 4),), {"axes": (2, 0, 1)}), ((_r(3, 4),), {"axes": None})],
    "getitem": [
        ((_r(5, 4),), {"index": (slice(1, 4), 2)}),
        ((_r(5, 4),), {"index": np.array([0, 2, 2, 4])}),
        ((_r(2, 3, 6),), {"index": (Ellipsis, slice(2, 4))}),
    ],
    "concatenate": [((_r(2, 3), _r(2, 5)), {"axis": 1}), ((_r(1, 3), _r(2, 3), _r(3, 3)), {"axis": 0})],
    "softmax": [((_r(3, 5),), {"axis": -1}), ((_r(4, 3),), {"axis": 0})],
    "log_softmax": [((_r(3, 5),), {"axis": -1})],
    "cross_entropy": [
        ((_r(6, 7),), {"targets": np.array([0, 3, 6, 1, 1, 2])}),
        ((_r(2, 3, 5),), {"targets": np.array([[0, -1, 4], [2, 2, -1]]), "ignore_index": -1}),
    ],
    "layer_norm": [((_r(3, 4, 6), _r(6), _r(6)), {"eps": 1e-5}), ((_r(5, 7), _r(7)), {"eps": 1e-5})],
    "layer_norm_linear": [
        ((_r(2, 3, 6), _r(6), _r(6), _r(6, 4), _r(4)), {"ln_bias": True, "bias": True, "eps": 1e-5}),
        ((_r(5, 7), _r(7), _r(4, 7)), {"ln_bias": False, "bias": False, "transpose_w": True}),
    ],
    "embedding": [((_r(7, 3),), {"idx": np.array([[0, 6, 2], [2, 2, 5]])})],
    "attention": [
        ((_r(2, 3, 5, 4), _r(2, 3, 5, 4), _r(2, 3, 5, 4)), {}),
        ((_r(1, 2, 7, 3), _r(1, 2, 7, 3), _r(1, 2, 7, 3)), {"scale": 0.7}),
    ],
    "attention_qkv": [((_r(2, 5, 12),), {"n_head": 2}), ((_r(1, 7, 9),), {"n_head": 3, "scale": 0.7})],
    "dropout": [((_r(4, 6),), {"p": 0.3, "seed": 11})],
}


def test_every_primitive_has_a_case():
    assert set(PRIMITIVES) == set(CASES), f"primitives without a case: {set(PRIMITIVES) - set(CASES)}"


@pytest.mark.parametrize(
    "name,arrays,settings",
    [(n, a, s) for n, cases in CASES.items() for a, s in cases],
    ids=[f"{n}-{i}" for n, cases in CASES.items() for i in range(len(cases))],
)
def test_vjp(name, arrays, settings, xp):
    arrays = [xp.asarray(a) for a in arrays]
    settings = {k: xp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in settings.items()}
    check_vjp(name, arrays, settings)


def test_check_vjp_catches_a_wrong_vjp(monkeypatch):
    """The checker itself can fail: a VJP with a wrong constant is caught."""
    good = PRIMITIVES["tanh"]
    bad = type(good)(good.name, good.forward, lambda g, out, a: (2 * g * (1 - out * out),))
    monkeypatch.setitem(PRIMITIVES, "tanh", bad)
    with pytest.raises(AssertionError, match="tanh: input 0"):
        check_vjp("tanh", [_r(3, 4)])


def test_unbroadcast_sums_broadcast_axes():
    g = np.ones((2, 3, 4))
    assert unbroadcast(g, (3, 1)).tolist() == [[8.0]] * 3
    assert unbroadcast(g, (4,)).tolist() == [6.0] * 4


def test_cross_entropy_matches_direct_formula_and_ignores():
    logits = _r(4, 5)
    targets = np.array([1, -1, 4, 0])
    loss = mpifsdp.ops.cross_entropy(mpifsdp.Tensor(logits), targets).item()
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    expect = -np.mean([logp[i, t] for i, t in enumerate(targets) if t != -1])
    assert loss == pytest.approx(expect, rel=1e-12)


def test_attention_is_causal():
    q, k, v = (_r(1, 1, 6, 4, seed=s) for s in range(3))
    full = mpifsdp.ops.attention(q, k, v).numpy()
    v2 = v.copy()
    v2[..., 4:, :] += 100.0  # future positions must not change earlier outputs
    changed = mpifsdp.ops.attention(q, k, v2).numpy()
    np.testing.assert_array_equal(full[..., :4, :], changed[..., :4, :])
    assert not np.allclose(full[..., 4:, :], changed[..., 4:, :])


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: mpifsdp.ops.matmul(np.ones((2, 3)), np.ones((4, 5))), "matmul"),
        (
            lambda: mpifsdp.ops.linear(np.ones((2, 3)), np.ones((4, 5))),
            "input has 3 features, weight \\(4, 5\\)",
        ),
        (
            lambda: mpifsdp.ops.cross_entropy(np.ones((2, 3)), np.zeros(3, dtype=int)),
            "targets \\(3,\\) must match",
        ),
        (
            lambda: mpifsdp.ops.embedding(np.ones((4, 2)), np.array([1, 4])),
            "span \\[1, 4\\] but the table has 4",
        ),
        (lambda: mpifsdp.ops.embedding(np.ones((4, 2)), np.array([1.0])), "must be integers"),
        (lambda: mpifsdp.ops.dropout(np.ones(3), 1.0, 0), "dropout probability"),
        (
            lambda: mpifsdp.ops.linear(np.ones((2, 3)), mpifsdp.Param(np.ones((4, 5)), "head.weight")),
            r"linear on inputs \(2, 3\) float64, parameter 'head.weight' \(4, 5\) float64: .*weight \(4, 5\)",
        ),
        (
            lambda: mpifsdp.Tensor(np.ones(3)) + np.ones(4),
            r"add on inputs \(3,\) float64, \(4,\) float64: operands could not be broadcast",
        ),
        (
            lambda: mpifsdp.Param(np.ones(3, np.float32), "w") * np.ones(3),
            r"mul: inputs of different dtypes \(parameter 'w' \(3,\) float32, \(3,\) float64\); cast",
        ),
    ],
)
def test_bad_input_messages(call, message):
    with pytest.raises((ValueError, TypeError, IndexError), match=message):
        call()
