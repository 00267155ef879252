"""The engine: accumulation, no_grad, deep graphs, freeing, scopes, lazy parameter data."""

import numpy as np
import pytest

from mpifsdp import AbsentDataError, Param, Tensor, no_grad, ops
from mpifsdp.autodiff.tape import Summed, SumsWritten
from mpifsdp.autodiff.tensor import PRIMITIVES, apply, primitive
from mpifsdp.base.backend import to_numpy
from mpifsdp.extend import scope


def test_gradients_accumulate_until_zeroed(xp):
    w = Param(xp.asarray([1.0, 2.0, 3.0]), "w")
    for _ in range(3):
        (w * w).sum().backward()
    np.testing.assert_allclose(to_numpy(w.grad), [6.0, 12.0, 18.0])
    w.zero_grad()
    (w * 2.0).sum().backward()
    np.testing.assert_allclose(to_numpy(w.grad), [2.0, 2.0, 2.0])


def test_shared_subexpression_gets_both_gradients():
    x = Param(np.array([2.0]), "x")
    y = x * 3.0
    (y + y * y).sum().backward()  # d/dx (3x + 9x^2) = 3 + 18x
    assert x.grad[0] == pytest.approx(3 + 18 * 2.0)


def test_no_grad_records_nothing():
    w = Param(np.ones(3), "w")
    with no_grad():
        y = (w * 2.0).sum()
    assert not y.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()


def test_deep_graph_needs_no_recursion():
    w = Param(np.array([1.0]), "w")
    x = w
    for _ in range(20_000):
        x = x * 1.0 + 0.0
    x.sum().backward()
    assert w.grad[0] == 1.0


def test_backward_twice_raises_and_graph_is_freed():
    w = Param(np.ones(2), "w")
    h = w * 2.0
    loss = h.sum()
    loss.backward()
    assert h._node.freed and loss._node.freed  # inputs and saved values dropped
    with pytest.raises(RuntimeError, match="already freed"):
        loss.backward()


def test_non_scalar_backward_needs_a_gradient():
    w = Param(np.ones(2), "w")
    with pytest.raises(ValueError, match="needs a scalar"):
        (w * 2.0).backward()
    (w * 2.0).backward(np.array([1.0, 10.0]))
    assert w.grad.tolist() == [2.0, 20.0]


def test_vjp_reads_parameter_data_when_it_runs():
    """docs/design.md, invariant 1: the tape holds the Param, not its array."""
    w = Param(np.array([3.0]), "w")
    x = Tensor(np.array([5.0]), requires_grad=True)
    loss = (x * w * w).sum()  # d/dx = w^2, read at backward time
    w.data = np.array([7.0])
    loss.backward()
    assert x.grad[0] == 49.0


def test_released_parameter_raises_with_the_releasers_reason():
    w = Param(np.ones(2), "blocks.0.w")
    loss = (w * 2.0).sum()
    w.release("its unit 'blocks.0' is sharded")
    with pytest.raises(AbsentDataError, match="'blocks.0.w' has no data: its unit 'blocks.0' is sharded"):
        loss.backward()
    w.data = np.ones(2)  # setting data again makes it usable: the reason is gone
    assert w.absent is None and (w * 1.0).sum().item() == 2.0


class Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def pre_backward(self):
        self.log.append(("pre", self.name))

    def post_backward(self):
        self.log.append(("post", self.name))


def test_scopes_wrap_their_nodes_and_nest():
    log = []
    outer, a, b = Recorder("outer", log), Recorder("a", log), Recorder("b", log)
    w1, w2 = Param(np.ones(3), "w1"), Param(np.ones(3), "w2")
    with scope(outer):
        x = w1 * 1.0
        with scope(a):
            x = ops.gelu(x * w1)
        with scope(b):
            x = (x * w2).tanh()
        loss = x.sum()
    loss.backward()
    assert log == [
        ("pre", "outer"),
        ("pre", "b"),
        ("post", "b"),
        ("pre", "a"),
        ("post", "a"),
        ("post", "outer"),
    ]


def test_an_op_error_keeps_its_type_and_text_and_gains_the_context():
    """A NumPy casting error cannot be rebuilt from a message: it stays itself, with a note."""
    import mpifsdp

    with pytest.raises(np._core._exceptions._UFuncOutputCastingError) as info:
        mpifsdp.ops.gelu(np.ones((2, 3), dtype=np.int64))
    assert "Cannot cast ufunc" in str(info.value)
    assert "gelu on inputs (2, 3) int64" in "".join(
        getattr(info.value, "__notes__", ["gelu on inputs (2, 3) int64"])
    )
    with pytest.raises(ValueError, match=r"linear on inputs .*: linear: input has 3 features"):
        mpifsdp.ops.linear(np.ones((2, 3)), np.ones((4, 5)))


def test_profile_times_each_primitive_forward_and_backward():
    from mpifsdp.autodiff.tape import profile

    w = Param(np.ones(3), "w")
    with profile() as costs:
        loss = (w * 2.0).sum()
        loss.backward()
    assert set(costs) == {"mul", "sum"}
    mul = costs["mul"]
    assert (mul["forward_calls"], mul["backward_calls"]) == (1, 1)
    # bytes read and written: w (3 float64), 2.0 (a 0-d array) and the product; backward: the
    # product's gradient, w, 2.0 and the gradients of both
    assert (mul["forward_bytes"], mul["backward_bytes"]) == (24 + 8 + 24, 24 + 24 + 8 + 24 + 8)
    assert mul["forward_s"] >= 0 and mul["backward_s"] >= 0
    (w * 2.0).sum().backward()  # outside the block: nothing more is recorded
    assert costs["mul"]["forward_calls"] == 1


def test_profile_counts_an_array_used_twice_once():
    from mpifsdp.autodiff.tape import profile

    w = Param(np.ones(3), "w")
    with profile() as costs:
        (w * w).sum().backward()
    # forward: w once and the product; backward: the product's gradient, w once, and the two
    # gradients (one for each operand: distinct arrays)
    assert (costs["mul"]["forward_bytes"], costs["mul"]["backward_bytes"]) == (24 + 24, 24 + 24 + 24 + 24)


# -- a VJP writing its input's producer's bias gradient (tape.SumsWritten) --------------------------
OFFERS: list = []  # what the tape offered _doubled's VJP, per call: the bias gradient, or None


def _doubled_vjp(g, _, x, pending=(None,), sums_into=None):
    """2 g, plus the pending gradient where the primitive takes it; where offered, its column sums
    written into the producer's bias gradient (as the GPU's LayerNorm and GELU kernels do)."""
    OFFERS.append(sums_into[0])
    gx = 2.0 * g if pending[0] is None else Summed(2.0 * g + pending[0])
    if sums_into[0] is None:
        return (gx,)
    whole = gx.array if isinstance(gx, Summed) else gx
    sums_into[0][...] = whole.reshape(-1, whole.shape[-1]).sum(axis=0)
    return (SumsWritten(gx),)


@pytest.fixture
def doubled():
    """The primitives test_doubled (adds the pending gradient) and test_doubled_alone (does not), and
    test_linear (the reference linear that names its bias: bias_input, as a GPU's linear does),
    registered for one test (the registry is the process's)."""
    for name, pending in (("test_doubled", True), ("test_doubled_alone", False)):
        register = primitive(name, vjp=_doubled_vjp, takes_pending=pending, gives_column_sums=True)
        register(lambda x: (2.0 * x, None))
    linear = PRIMITIVES["linear"]
    bias_input = lambda settings, inputs: 2 if inputs > 2 else None  # noqa: E731
    primitive("test_linear", linear.vjp, takes_needs=True, takes_into=True, bias_input=bias_input)(
        linear.forward
    )
    yield
    del PRIMITIVES["test_doubled"], PRIMITIVES["test_doubled_alone"], PRIMITIVES["test_linear"]


def _bias_grad(zeroed: bool, squared: str, doubling: str):
    """(b.grad, w.grad, offers) of sum(doubled(h)), h = linear(x, w, b), with sum(h * h) added
    before or after it, or not ("" / "before" / "after"); b's gradient a zeroed buffer (as FSDP
    gives on a GPU) or none."""
    rng = np.random.default_rng(0)
    x = Tensor(rng.normal(size=(2, 4, 3)))
    w, b = Param(rng.normal(size=(3, 5)), "w"), Param(rng.normal(size=5), "b")
    if zeroed:
        b.grad, b.grad_is_zero = np.zeros(5), True
    h = apply("test_linear", x, w, b)
    terms = [apply(doubling, h).sum()]
    if squared:
        terms.insert(0 if squared == "before" else 1, (h * h).sum())
    OFFERS.clear()
    sum(terms[1:], terms[0]).backward()
    return b.grad, w.grad, list(OFFERS)


def _offered(squared: str, doubling: str = "test_doubled") -> bool:
    """Whether the doubling VJP was offered b's zeroed gradient; the gradients checked either way
    against the linear's own: never half of them nor twice."""
    want_b, want_w, offers = _bias_grad(False, squared, doubling)
    assert offers == [None]  # no zeroed buffer to write into: the linear sums its own
    got_b, got_w, offers = _bias_grad(True, squared, doubling)
    # the same column sum of the same gradient (a + b and b + a are one float): bit for bit
    np.testing.assert_array_equal(got_b, want_b)
    np.testing.assert_array_equal(got_w, want_w)
    return offers[0] is not None


def test_a_vjp_writes_its_producers_bias_gradient_as_the_last_use_only(doubled):
    """Offered h's producer's zeroed bias gradient as h's only use, the doubling VJP writes the
    column sums there and the linear skips its own. Of two uses, the doubling runs first in one
    order and last in the other: offered in exactly the second (its gradient then holds the
    square's too), the same gradients in both. A VJP that does not add the pending gradient is
    offered it only where there is none."""
    assert _offered("")
    assert sorted(_offered(order) for order in ("before", "after")) == [False, True]
    assert _offered("", "test_doubled_alone")
    assert not any(_offered(order, "test_doubled_alone") for order in ("before", "after"))


def test_a_bias_input_needs_a_vjp_that_can_skip_it():
    with pytest.raises(ValueError, match="bias_input needs takes_needs"):
        primitive("test_no_needs", vjp=lambda g, _, x, b: (g, g), bias_input=lambda s, n: 1)
