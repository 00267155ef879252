"""A small reverse-mode autodiff: Tensors, a registry of primitives with their VJPs, a tape, scopes.

Each primitive is a pair of plain array functions (see ops.py):
    forward(*arrays, **settings) -> (out, saved)
    vjp(g, saved, *arrays, **settings) -> one gradient (or None) per array input
Arrays are positional, settings are keyword (as in JAX's Autodidax).

[Note: lazy parameter data] A node keeps its input *Tensors* (or shape-only stand-ins for inputs its
VJP never reads), never their arrays; `backward` reads `tensor.data` only when the VJP runs, and
`saved` may hold activations but never a parameter's array.
That is what lets FSDP free a unit's gathered parameters after forward and gather them again before
backward (docs/design.md, invariant 1). A Param whose data is absent raises, naming its owner.

Scopes: while `with scope(obj):` is active, every recorded node remembers obj (scopes nest). During
backward, obj.pre_backward() runs before the first of its nodes and obj.post_backward() after the last
one; an outer scope's post_backward therefore runs after everything recorded inside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .backend import array_module_of, to_numpy


@dataclass(frozen=True)
class Primitive:
    name: str
    forward: Callable
    vjp: Callable
    reads_inputs: bool = True  # False: the VJP needs only the inputs' shapes, never their values


PRIMITIVES: dict[str, Primitive] = {}


def primitive(name: str, vjp: Callable, reads_inputs: bool = True):
    """Decorator registering `forward` under `name` with its `vjp`; returns the Primitive.

    reads_inputs=False lets the tape drop its reference to the input arrays (only their shapes are
    kept), so activations consumed only by such ops (add, reshape, ...) are freed during forward.
    """

    def register(forward):
        if name in PRIMITIVES:
            raise ValueError(f"primitive {name!r} registered twice")
        PRIMITIVES[name] = Primitive(name, forward, vjp, reads_inputs)
        return PRIMITIVES[name]

    return register


class ArrayMeta:
    """What a shape-only VJP may know of an input array: shape, dtype, ndim, size."""

    __slots__ = ("shape", "dtype", "ndim", "size")

    def __init__(self, array):
        self.shape, self.dtype, self.ndim, self.size = array.shape, array.dtype, array.ndim, array.size


class _State(threading.local):
    def __init__(self):
        self.grad_enabled = True
        self.scopes: tuple = ()


_state = _State()


@contextlib.contextmanager
def no_grad():
    """Run ops without recording them: no graph, no memory held for backward."""
    previous, _state.grad_enabled = _state.grad_enabled, False
    try:
        yield
    finally:
        _state.grad_enabled = previous


def grad_enabled() -> bool:
    return _state.grad_enabled


@contextlib.contextmanager
def scope(owner):
    """Record nodes created inside under `owner` (an object with pre_backward/post_backward)."""
    previous = _state.scopes
    _state.scopes = previous + (owner,)
    try:
        yield
    finally:
        _state.scopes = previous


class Node:
    """One recorded primitive application: what backward needs to run its VJP.

    `inputs` are the input Tensors, or shape-only stand-ins (see Primitive.reads_inputs) that share
    the producer's node. Backward empties `inputs` and `saved` once the VJP has run.
    """

    __slots__ = ("prim", "inputs", "saved", "settings", "scopes")

    def __init__(self, prim, inputs, saved, settings, scopes):
        self.prim, self.inputs, self.saved, self.settings, self.scopes = prim, inputs, saved, settings, scopes

    @property
    def freed(self) -> bool:
        return self.inputs is None


class Tensor:
    """An array with an optional gradient and the node that produced it."""

    __array_priority__ = 100  # make `ndarray + Tensor` call Tensor.__radd__

    def __init__(self, data, requires_grad: bool = False):
        self._data = data
        self.requires_grad = requires_grad
        self.grad = None
        self._node: Node | None = None

    # -- data -----------------------------------------------------------------------------------
    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    @property
    def xp(self):
        return array_module_of(self.data)

    def numpy(self) -> np.ndarray:
        return to_numpy(self.data)

    def item(self) -> float:
        return float(self.numpy().reshape(()))

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def _accumulate_grad(self, g):
        """Add `g` into .grad in place (a view set by FSDP stays a view); own a copy the first time."""
        if self.grad is None:
            self.grad = g.astype(self.dtype, copy=True)
        else:
            self.grad += g

    def zero_grad(self):
        self.grad = None

    def backward(self, grad=None):
        backward(self, grad)

    # -- operators: thin sugar over the registry (primitives live in ops.py) ----------------------
    def __add__(self, other):
        return apply("add", self, other)

    def __radd__(self, other):
        return apply("add", other, self)

    def __sub__(self, other):
        return apply("sub", self, other)

    def __rsub__(self, other):
        return apply("sub", other, self)

    def __mul__(self, other):
        return apply("mul", self, other)

    def __rmul__(self, other):
        return apply("mul", other, self)

    def __truediv__(self, other):
        return apply("div", self, other)

    def __rtruediv__(self, other):
        return apply("div", other, self)

    def __neg__(self):
        return apply("neg", self)

    def __pow__(self, exponent: float):
        return apply("pow", self, exponent=float(exponent))

    def __matmul__(self, other):
        return apply("matmul", self, other)

    def __rmatmul__(self, other):
        return apply("matmul", other, self)

    def __getitem__(self, index):
        return apply("getitem", self, index=index)

    def sum(self, axis=None, keepdims=False):
        return apply("sum", self, axis=axis, keepdims=keepdims)

    def mean(self, axis=None, keepdims=False):
        return apply("mean", self, axis=axis, keepdims=keepdims)

    def max(self, axis=None, keepdims=False):
        return apply("max", self, axis=axis, keepdims=keepdims)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return apply("reshape", self, shape=tuple(shape))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return apply("transpose", self, axes=tuple(axes) if axes else None)

    @property
    def T(self):
        return self.transpose()

    def astype(self, dtype):
        return self if self.dtype == dtype else apply("astype", self, dtype=np.dtype(dtype))

    def exp(self):
        return apply("exp", self)

    def log(self):
        return apply("log", self)

    def tanh(self):
        return apply("tanh", self)

    def sqrt(self):
        return apply("sqrt", self)


class ShardedParameterError(RuntimeError):
    """A parameter was used while the FSDP unit that owns it held only its shard."""


class Param(Tensor):
    """A trainable leaf. Its data may be absent: while its FSDP unit is sharded, or before a deferred
    parameter is materialized (layers.deferred_init); reading it then raises. Its shape and dtype are
    fixed at creation and always known."""

    def __init__(self, data, name: str = "", shape=None, dtype=None, initial=None):
        super().__init__(data, requires_grad=True)
        self.name = name
        self.unit_name: str | None = None  # set by the FSDP unit that owns this parameter
        self._shape = tuple(data.shape) if data is not None else tuple(shape)
        self._dtype = np.dtype(data.dtype if data is not None else dtype)
        self._initial = initial  # deferred: a function returning the initial array

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        """The dtype it computes in now (mixed precision binds float16 views), else its own."""
        return self._dtype if self._data is None else self._data.dtype

    @property
    def ndim(self):
        return len(self._shape)

    @property
    def size(self):
        return int(np.prod(self._shape, dtype=np.int64))

    def initial_value(self):
        """The array this parameter starts from: its data, or (deferred) freshly made from its seed."""
        return self._initial() if self._data is None and self._initial is not None else self.data

    @property
    def data(self):
        if self._data is None and self.unit_name is None and self._initial is not None:
            raise ShardedParameterError(
                f"parameter {self.name!r} was built under deferred_init() and has no values yet: "
                "fully_shard() the model first (it materializes one unit at a time)"
            )
        if self._data is None:
            raise ShardedParameterError(
                f"parameter {self.name!r} was used while its unit {self.unit_name!r} is sharded "
                "(its full values exist only inside that unit's forward and backward). Call it "
                "through the module that owns it, or wrap the code in `with unit.unsharded():`."
            )
        return self._data

    @data.setter
    def data(self, value):
        self._data = value

    def __repr__(self):
        return f"Param({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def as_tensor(value, like: Tensor | None = None) -> Tensor:
    """Wrap arrays and Python scalars as constant Tensors (scalars take `like`'s dtype and device)."""
    if isinstance(value, Tensor):
        return value
    if like is not None and np.isscalar(value):
        return Tensor(like.xp.asarray(value, dtype=like.dtype))
    return Tensor(value)


def _describe(t: Tensor) -> str:
    label = f"parameter {t.name!r} " if isinstance(t, Param) else ""
    return f"{label}{tuple(t.shape)} {t.dtype}"


def _same_error(exc: Exception, message: str) -> Exception | None:
    """An exception of exc's type carrying `message`, or None where that type needs more than one
    message to be built (NumPy's casting errors): never a different error than the one that happened."""
    try:
        rebuilt = type(exc)(message)
    except Exception:
        return None
    return rebuilt if str(rebuilt) == message else None


def apply(name: str, *args, **settings) -> Tensor:
    """Run primitive `name` on `args` (Tensors, arrays or scalars) and record it when grads are needed."""
    prim = PRIMITIVES[name]
    like = next((a for a in args if isinstance(a, Tensor)), None)
    inputs = tuple(as_tensor(a, like) for a in args)
    float_dtypes = {t.dtype for t in inputs if t.dtype.kind == "f"}
    if len(float_dtypes) > 1:  # numpy would silently promote, and gradients would change dtype
        raise TypeError(
            f"{name}: inputs of different dtypes ({', '.join(map(_describe, inputs))}); "
            "cast them to one dtype first (e.g. x.astype(np.float32))"
        )
    try:
        out, saved = prim.forward(*(t.data for t in inputs), **settings)
    except (ValueError, TypeError, IndexError) as exc:
        context = f"{name} on inputs {', '.join(map(_describe, inputs))}"
        rebuilt = _same_error(exc, f"{context}: {exc}")
        if rebuilt is None:  # its type cannot be rebuilt from a message: keep it, add the context
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(context)
            raise
        raise rebuilt from exc
    result = Tensor(out)
    if _state.grad_enabled and any(t.requires_grad for t in inputs):
        result.requires_grad = True
        kept = inputs if prim.reads_inputs else tuple(map(_shape_only, inputs))
        result._node = Node(prim, kept, saved, settings, _state.scopes)
    return result


def _shape_only(t: Tensor) -> Tensor:
    """A stand-in for a non-leaf input: same node and requires_grad, its array replaced by ArrayMeta."""
    if t._node is None:  # leaves (parameters, inputs) are kept: their .grad is where gradients go
        return t
    stub = Tensor(ArrayMeta(t.data), t.requires_grad)
    stub._node = t._node
    return stub


def _nodes_in_reverse_order(root: Node) -> list[Node]:
    """Nodes reachable from `root`, each after every node that consumes its output.

    Iterative depth-first post-order (no recursion limit on deep models), then reversed.
    """
    order, visited = [], set()
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        for t in node.inputs:
            if t._node is not None and id(t._node) not in visited:
                stack.append((t._node, False))
    order.reverse()
    return order


def graph_nbytes(root: Tensor) -> int:
    """Bytes of the distinct arrays the graph behind `root` keeps for backward (activations)."""
    seen_arrays, total = set(), 0
    for node in _nodes_in_reverse_order(root._node):
        held = [t._data for t in node.inputs if not isinstance(t, Param) and hasattr(t._data, "base")]
        stack = held + [node.saved]
        while stack:
            item = stack.pop()
            if isinstance(item, (tuple, list)):
                stack.extend(item)
            elif hasattr(item, "nbytes") and hasattr(item, "base"):
                base = item if item.base is None else item.base
                if id(base) not in seen_arrays:
                    seen_arrays.add(id(base))
                    total += base.nbytes
    return total


def backward(root: Tensor, grad=None):
    """Accumulate d(root)/d(leaf) into every leaf's .grad, freeing the graph as it goes."""
    if root._node is None:
        raise RuntimeError(
            "this tensor does not require grad: its forward ran under no_grad() or used no "
            "trainable parameters, so there is nothing to differentiate"
        )
    if root._node.freed:
        raise RuntimeError(
            "backward() through a graph that was already freed: run the forward again before "
            "calling backward() a second time"
        )
    if grad is None:
        if root.size != 1:
            raise ValueError(f"backward() without a gradient needs a scalar, got shape {root.shape}")
        grad = root.xp.ones_like(root.data)

    order = _nodes_in_reverse_order(root._node)
    remaining: dict[int, int] = {}  # per scope: nodes still to run
    for node in order:
        for s in node.scopes:
            remaining[id(s)] = remaining.get(id(s), 0) + 1
    started: set[int] = set()

    grads = {id(root._node): grad}  # keyed by node: one output per node
    for node in order:
        for s in node.scopes:
            if id(s) not in started:
                started.add(id(s))
                s.pre_backward()
        g = grads.pop(id(node), None)
        if g is not None:
            arrays = [t.data for t in node.inputs]  # read now: lazy parameter data
            input_grads = node.prim.vjp(g, node.saved, *arrays, **node.settings)
            for t, gi in zip(node.inputs, input_grads):
                if gi is None or not t.requires_grad:
                    continue
                if t._node is None:
                    t._accumulate_grad(gi)
                elif id(t._node) in grads:
                    key = id(t._node)
                    grads[key] = grads[key] + gi  # not in place: a VJP may return shared arrays
                else:
                    grads[id(t._node)] = gi
        node.inputs = node.saved = None  # free the graph as we go
        for s in reversed(node.scopes):
            remaining[id(s)] -= 1
            if remaining[id(s)] == 0:
                s.post_backward()
