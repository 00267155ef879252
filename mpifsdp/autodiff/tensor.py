"""A small reverse-mode autodiff: Tensors, Params, a registry of primitives with their VJPs.

Each primitive is a pair of plain array functions (see ops/primitives.py):
    forward(*arrays, **settings) -> (out, saved)
    vjp(g, saved, *arrays, **settings) -> one gradient (or None) per array input
Arrays are positional, settings are keyword (as in JAX's Autodidax).

[Note: lazy parameter data] A node keeps its input *Tensors* (or shape-only stand-ins for inputs its
VJP never reads), never their arrays; `backward` reads `tensor.data` only when the VJP runs, and
`saved` may hold activations but never a parameter's array.
That is what lets FSDP free a unit's gathered parameters after forward and gather them again before
backward (docs/design.md, invariant 1). A Param whose data is absent raises, saying why (whoever took
its data gave the reason). The tape itself (nodes, no_grad, scopes, backward) is tape.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..base import deferred
from ..base.backend import array_module_of, device_kind, host_values, to_numpy
from ..base.checks import is_floating
from .tape import Node, active_scopes, backward, grad_enabled, nodes_in_reverse_order, timed


@dataclass(frozen=True)
class Primitive:
    name: str
    forward: Callable
    vjp: Callable
    reads_inputs: bool = True  # False: the VJP needs only the inputs' shapes, never their values
    takes_needs: bool = False  # True: the VJP gets needs=(bool per input) and skips unneeded gradients
    takes_into: bool = False  # True: the VJP gets into=(a zeroed .grad or None, per input): see WROTE
    takes_pending: bool = False  # True: the VJP gets pending=(gradient so far, per input): see Summed
    gives_column_sums: bool = False  # True: the VJP gets sums_into=(a bias gradient or None, per input)
    bias_input: Callable | None = None  # (settings, number of inputs) -> the index of the bias, or None


PRIMITIVES: dict[str, Primitive] = {}  # the reference implementations (NumPy's arithmetic, any device)
# [Note: the device seam] A primitive may have, beside its reference, an implementation of its own
# for a device (mpifsdp/cuda/ registers the GPU's: its kernels and their fusions), the way mpi4jax
# lowers one operation per platform. `apply` picks it by the device of the primitive's first input;
# no operation, layer or model asks which device it runs on.
ON_DEVICE: dict[tuple[str, str], Primitive] = {}
FUSIONS: dict[tuple[str, str], dict] = {}  # (name, device) -> the fusions that implementation offers


def primitive(
    name: str,
    vjp: Callable,
    reads_inputs: bool = True,
    takes_needs: bool = False,
    takes_into: bool = False,
    takes_pending: bool = False,
    gives_column_sums: bool = False,
    bias_input: Callable | None = None,
):
    """Decorator registering `forward` under `name` with its `vjp`; returns the Primitive.

    reads_inputs=False lets the tape drop its reference to the input arrays (only their shapes are
    kept), so activations consumed only by such ops (add, reshape, ...) are freed during forward.
    takes_needs=True: backward passes the VJP `needs`, one bool per input (does it require grad?), so
    the gradient of a frozen weight is never computed (it may return None there).
    takes_into=True: backward passes `into`, per input the parameter's .grad where nothing has added
    to it yet (FSDP's fresh flat gradient, Param.grad_is_zero: zeros, or memory the first gradient is
    written over), else None; the VJP may write that input's gradient there (a GEMM's output, say)
    and return tape.WROTE for it: no temporary, no copy, and no launch to add it on a GPU.
    takes_pending=True: backward passes `pending`, per input the gradient its other uses gave it so
    far (a residual stream's, say; None for leaves and where there is none yet); the VJP may return
    tape.Summed(its gradient + that) for it, formed in its own kernel: the add is not a launch of its own.
    bias_input(settings, number of inputs): the index of an input whose gradient is the column sum
    (over every axis but the last) of this primitive's output gradient, a linear's bias; None: none.
    gives_column_sums=True: backward passes `sums_into`, per input t the zeroed gradient of the bias
    of the primitive that made t (where that one has a bias_input, and this is t's last use), else
    None; the VJP may write there the column sums of t's whole gradient (its own plus `pending`),
    formed in the kernel that forms that gradient, and return tape.SumsWritten(t's gradient): the
    producer's VJP then skips its bias gradient (no reduction launch of its own).
    """

    if bias_input is not None and not takes_needs:  # its VJP must be able to skip the bias
        raise ValueError(f"primitive {name!r}: bias_input needs takes_needs=True")

    def register(forward):
        if name in PRIMITIVES:
            raise ValueError(f"primitive {name!r} registered twice")
        flags = (reads_inputs, takes_needs, takes_into, takes_pending, gives_column_sums)
        PRIMITIVES[name] = Primitive(name, forward, vjp, *flags, bias_input)
        return PRIMITIVES[name]

    return register


def implement(name: str, device: str, vjp: Callable | None = None, fusions: dict | None = None, **flags):
    """Decorator registering `forward` as primitive `name`'s implementation on `device` ('cuda'), with
    its own `vjp` (else the reference's) and flags (the reference's, updated by `flags`: a device's
    VJP may take more, see `primitive`). fusions: what this implementation offers beyond the
    reference, by name (`fusion` answers a layer that asks before it passes such a setting)."""

    def register(forward):
        reference = PRIMITIVES[name]
        if (name, device) in ON_DEVICE:
            raise ValueError(f"primitive {name!r} has an implementation on {device!r} already")
        own = dataclasses.replace(reference, forward=forward, vjp=vjp or reference.vjp, **flags)
        ON_DEVICE[name, device], FUSIONS[name, device] = own, dict(fusions or {})
        return own

    return register


def implementation(name: str, array) -> Primitive:
    """Primitive `name` as it runs on the device holding `array`: that device's own, else the reference."""
    return implementation_on(name, device_kind(array))


def implementation_on(name: str, device: str) -> Primitive:
    """Primitive `name` as it runs on `device` ('cpu', 'cuda')."""
    return ON_DEVICE.get((name, device), PRIMITIVES[name])


def fusion(name: str, which: str, array):
    """What primitive `name`'s implementation on the device holding `array` registered as fusion
    `which` (a value, a class, a predicate), or None: the reference offers none."""
    return FUSIONS.get((name, device_kind(array)), {}).get(which)


class ArrayMeta:
    """What a shape-only VJP may know of an input array: shape, dtype, ndim, size."""

    __slots__ = ("shape", "dtype", "ndim", "size")

    def __init__(self, array):
        self.shape, self.dtype, self.ndim, self.size = array.shape, array.dtype, array.ndim, array.size


class Tensor:
    """An array with an optional gradient and the node that produced it."""

    # NumPy and CuPy arrays step aside for a Tensor: `ndarray + Tensor` calls Tensor.__radd__ instead
    # of broadcasting the Tensor as an object (a priority alone ties CuPy's own and loses to it).
    __array_ufunc__ = None

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
        """The values on the host; a device batch's input checks still pending (base/deferred.py)
        are read too, and a failed one raises: a loss is not reported from a bad batch."""
        value = to_numpy(self.data)
        deferred.raise_failed(*deferred.read_pending(host_values))
        return value

    def item(self) -> float:
        return float(self.numpy().reshape(()))

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def _accumulate_grad(self, g):
        """Add `g` into .grad in place (a view set by FSDP stays a view); own a copy the first time,
        and write it into a buffer nothing has written yet (grad_unfilled)."""
        if self.grad is None:
            self.grad = g.astype(self.dtype, copy=True)
        elif getattr(self, "grad_unfilled", False):
            self.grad[...] = g
        else:
            self.grad += g
        self.grad_is_zero = self.grad_unfilled = False

    def zero_grad(self):
        self.grad = None

    def backward(self, grad=None):
        backward(self, grad)

    # -- operators: thin sugar over the registry (primitives live in ops/primitives.py) ---------
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


class AbsentDataError(RuntimeError):
    """A parameter was used while its data was absent (its FSDP unit sharded, or not yet built)."""


class Param(Tensor):
    """A trainable leaf: data, grad and name. Its data may be absent (`release`): while its FSDP unit
    is sharded, or before a deferred parameter is built (layers.deferred_init); reading it then
    raises with the reason the releaser gave. Its shape and dtype are fixed at creation."""

    def __init__(self, data, name: str = "", shape=None, dtype=None, absent: str | None = None):
        super().__init__(data, requires_grad=True)
        self.name = name
        # True while .grad is a buffer its binder zeroed and nothing has added to: a VJP may then
        # write the gradient there instead of adding it (primitive's takes_into). grad_unfilled: the
        # binder did not even zero it (FSDP on a GPU): the first gradient must be written, not added
        self.grad_is_zero = self.grad_unfilled = False
        self._shape = tuple(data.shape) if data is not None else tuple(shape)
        self._dtype = np.dtype(data.dtype if data is not None else dtype)
        self.absent = absent if data is None else None  # why there is no data, while there is none

    def release(self, reason: str):
        """Drop the data; until it is set again, reading it raises AbsentDataError with `reason`."""
        self._data, self.absent = None, reason

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
        return math.prod(int(d) for d in self._shape)  # a Python integer: exact at any size

    @property
    def data(self):
        if self._data is None:
            raise AbsentDataError(f"parameter {self.name!r} has no data: {self.absent or 'none was given'}")
        return self._data

    @data.setter
    def data(self, value):
        self._data = value
        self.absent = None

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
    like = next((a for a in args if isinstance(a, Tensor)), None)
    inputs = tuple(as_tensor(a, like) for a in args)
    prim = implementation(name, inputs[0].data)  # the device seam
    float_dtypes = {t.dtype for t in inputs if is_floating(t.dtype)}
    if len(float_dtypes) > 1:  # numpy would silently promote, and gradients would change dtype
        raise TypeError(
            f"{name}: inputs of different dtypes ({', '.join(map(_describe, inputs))}); "
            "cast them to one dtype first (e.g. x.astype(np.float32))"
        )
    try:
        out, saved = timed(name, "forward", prim.forward, *(t.data for t in inputs), **settings)
    except (ValueError, TypeError, IndexError) as exc:
        context = f"{name} on inputs {', '.join(map(_describe, inputs))}"
        rebuilt = _same_error(exc, f"{context}: {exc}")
        if rebuilt is None:  # its type cannot be rebuilt from a message: keep it, add the context
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(context)
            raise
        raise rebuilt from exc
    result = Tensor(out)
    if grad_enabled() and any(t.requires_grad for t in inputs):
        result.requires_grad = True
        kept = inputs if prim.reads_inputs else tuple(map(_shape_only, inputs))
        result._node = Node(prim, kept, saved, settings, active_scopes())
    return result


def _shape_only(t: Tensor) -> Tensor:
    """A stand-in for a non-leaf input: same node and requires_grad, its array replaced by ArrayMeta."""
    if t._node is None:  # leaves (parameters, inputs) are kept: their .grad is where gradients go
        return t
    stub = Tensor(ArrayMeta(t.data), t.requires_grad)
    stub._node = t._node
    return stub


def graph_nbytes(root: Tensor) -> int:
    """Bytes of the distinct arrays the graph behind `root` keeps for backward (activations)."""
    seen_arrays, total = set(), 0
    for node in nodes_in_reverse_order(root._node):
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
