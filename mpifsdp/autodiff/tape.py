"""The tape: recorded nodes, the recording state (no_grad, scopes), and the backward sweep.

Each Node is one primitive application (see tensor.py): the primitive, its inputs, what its forward
saved for the VJP, its settings, and the scopes active when it ran. `backward` runs the VJPs from a
root to the leaves, in reverse topological order, freeing each node once its VJP has run.

Scopes: while `with scope(obj):` is active, every recorded node remembers obj (scopes nest). During
backward, obj.pre_backward() runs before the first of its nodes and obj.post_backward() after the last
one; an outer scope's post_backward therefore runs after everything recorded inside it. That is the
whole interface between autodiff and whatever drives it (fsdp/lifecycle.py's units, fsdp/model.py).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

from ..base.backend import synchronize


class _Recording(threading.local):
    """Per thread: whether ops are recorded, and the scopes new nodes belong to."""

    def __init__(self):
        self.grad_enabled = True
        self.scopes: tuple = ()
        self.profile: dict | None = None  # while profiling: primitive -> its forward and VJP costs


_recording = _Recording()


@contextlib.contextmanager
def no_grad():
    """Run ops without recording them: no graph, no memory held for backward."""
    previous, _recording.grad_enabled = _recording.grad_enabled, False
    try:
        yield
    finally:
        _recording.grad_enabled = previous


def grad_enabled() -> bool:
    return _recording.grad_enabled


def active_scopes() -> tuple:
    return _recording.scopes


@contextlib.contextmanager
def scope(owner):
    """Record nodes created inside under `owner` (an object with pre_backward/post_backward)."""
    previous = _recording.scopes
    _recording.scopes = previous + (owner,)
    try:
        yield
    finally:
        _recording.scopes = previous


@contextlib.contextmanager
def fresh_recording():
    """Record with grad on and no enclosing scope: a forward re-run inside a VJP (recompute.py), whose
    nodes belong to the node being differentiated, not to the scopes that node ran under."""
    previous = _recording.grad_enabled, _recording.scopes
    _recording.grad_enabled, _recording.scopes = True, ()
    try:
        yield
    finally:
        _recording.grad_enabled, _recording.scopes = previous


@contextlib.contextmanager
def profile():
    """`with profile() as costs:` every primitive's forward and VJP timed while inside: costs[name] =
    {"forward_s", "forward_calls", "forward_bytes", "backward_s", "backward_calls", "backward_bytes"}.
    Bytes: of the distinct arrays a phase reads and writes (its array arguments and results), the
    least memory traffic it can have, so bytes / seconds tells a pass bound by memory from one
    bound by arithmetic. What a step spends outside primitives (optimizer, communication) is the rest."""
    previous, _recording.profile = _recording.profile, {}
    try:
        yield _recording.profile
    finally:
        _recording.profile = previous


def timed(name: str, phase: str, run, *args, **kwargs):
    """run(*args, **kwargs), its time added to the active profile (just the call when none is)."""
    costs = _recording.profile
    if costs is None:
        return run(*args, **kwargs)
    first = args[0] if args else None  # a GPU runs kernels asynchronously: the stream is drained
    synchronize(first)  # before and after, so this primitive's kernels are timed, not the queue's
    start = time.perf_counter()
    result = run(*args, **kwargs)
    synchronize(first)
    entry = costs.setdefault(
        name, dict.fromkeys((f"{p}_{k}" for p in ("forward", "backward") for k in ("s", "calls", "bytes")), 0)
    )
    entry[f"{phase}_s"] += time.perf_counter() - start
    entry[f"{phase}_calls"] += 1
    entry[f"{phase}_bytes"] += sum(a.nbytes for a in _arrays_in((args, result), {}).values())
    return result


def _arrays_in(value, found: dict) -> dict:
    """found, with every array in value (nested in tuples and lists) added once, by identity."""
    if isinstance(value, (tuple, list)):
        for v in value:
            _arrays_in(v, found)
    elif hasattr(value, "nbytes") and hasattr(value, "shape"):
        found[id(value)] = value
    return found


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


def nodes_in_reverse_order(root: Node) -> list[Node]:
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


def backward(root, grad=None):
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

    order = nodes_in_reverse_order(root._node)
    remaining: dict[int, int] = {}  # per scope: nodes still to run
    for node in order:
        for s in node.scopes:
            remaining[id(s)] = remaining.get(id(s), 0) + 1
    started: dict[int, object] = {}  # scopes whose pre_backward ran, by id, in order

    sweep = _Sweep({id(root._node): grad}, _consumers(order))
    try:
        for node in order:
            for s in node.scopes:
                if id(s) not in started:
                    started[id(s)] = s
                    s.pre_backward()
            g = sweep.grads.pop(id(node), None)
            if g is not None:
                _propagate(node, g, sweep)
            sweep.consumed(node)
            node.inputs = node.saved = None  # free the graph as we go
            for s in reversed(node.scopes):
                remaining[id(s)] -= 1
                if remaining[id(s)] == 0:
                    s.post_backward()
    except BaseException:
        # Scopes cut short learn it at once, innermost first (FSDP: nothing may stay in flight or
        # gathered once the arrays MPI writes into can be freed), then the error propagates.
        for s in reversed(list(started.values())):
            if remaining[id(s)] and hasattr(s, "backward_failed"):
                s.backward_failed()
        raise


# What a VJP returns for an input whose gradient it wrote into `into` itself (primitive's takes_into).
WROTE = object()


class Summed:
    """What a VJP returns for an input whose `pending` gradient it added to its own (primitive's
    takes_pending): the tape takes `array` as that input's gradient so far, with no add of its own."""

    def __init__(self, array):
        self.array = array


class SumsWritten:
    """What a VJP returns for an input whose whole gradient's column sums it also wrote into
    `sums_into` (primitive's gives_column_sums): `grad` is what it returns for that input otherwise
    (an array, or a Summed)."""

    def __init__(self, grad):
        self.grad = grad


def _zeroed_grad(t) -> bool:
    """A leaf whose .grad is a zeroed buffer nothing has added to yet (Param.grad_is_zero)."""
    return t._node is None and t.requires_grad and t.grad is not None and getattr(t, "grad_is_zero", False)


def _consumers(order: list) -> collections.Counter:
    """Per node (by id): how many inputs of nodes in `order` are its output."""
    counts = collections.Counter()
    for node in order:
        for t in node.inputs:
            if t._node is not None:
                counts[id(t._node)] += 1
    return counts


class _Sweep:
    """One backward's running state: the gradients of outputs so far (by node), how many of each
    output's uses have still to give theirs, and the nodes whose bias gradient a consumer wrote."""

    def __init__(self, grads: dict, consumers: collections.Counter):
        self.grads, self.left, self.bias_written = grads, consumers, set()

    def consumed(self, node: Node):
        for t in node.inputs or ():
            if t._node is not None:
                self.left[id(t._node)] -= 1

    def bias_grad_of(self, t, adds_pending: bool):
        """Where the VJP running now (a use of t, which a node made) may write the column sums of
        t's whole gradient: the zeroed gradient of the bias of the node that made t, when this is
        t's last use (its gradient is then complete with the pending one, which a VJP that does not
        take it must not have); else None."""
        producer = t._node
        if self.left[id(producer)] != 1:
            return None
        if not adds_pending and id(producer) in self.grads:
            return None
        bias = _bias_of(producer)
        if bias is None or not _zeroed_grad(bias) or bias.grad.shape != (t.shape[-1],):
            return None
        return bias.grad


def _bias_of(node: Node):
    """The input of `node` whose gradient is the column sum of node's output gradient (its
    primitive's bias_input: a linear's bias), or None."""
    bias_input = getattr(node.prim, "bias_input", None)
    index = None if bias_input is None else bias_input(node.settings, len(node.inputs))
    return None if index is None else node.inputs[index]


def _propagate(node: Node, g, sweep: _Sweep):
    """Run node's VJP on its output gradient g; add the results to its inputs' (leaves: their .grad)."""
    grads = sweep.grads
    arrays = [t.data for t in node.inputs]  # read now: lazy parameter data
    settings = node.settings
    if getattr(node.prim, "takes_needs", False):  # skip the gradients of frozen inputs
        written = _bias_of(node) if id(node) in sweep.bias_written else None  # by a consumer
        settings = {**settings, "needs": tuple(t.requires_grad and t is not written for t in node.inputs)}
    if getattr(node.prim, "takes_into", False):  # zeroed parameter gradients the VJP may write into
        settings = {**settings, "into": tuple(t.grad if _zeroed_grad(t) else None for t in node.inputs)}
    if getattr(node.prim, "takes_pending", False):  # the inputs' gradients so far, the VJP may add in
        pending = tuple(None if t._node is None else grads.get(id(t._node)) for t in node.inputs)
        settings = {**settings, "pending": pending}
    if getattr(node.prim, "gives_column_sums", False):  # producers' bias gradients it may write
        adds_pending = getattr(node.prim, "takes_pending", False)
        offers = [None if t._node is None else sweep.bias_grad_of(t, adds_pending) for t in node.inputs]
        settings = {**settings, "sums_into": tuple(offers)}
    input_grads = timed(node.prim.name, "backward", node.prim.vjp, g, node.saved, *arrays, **settings)
    for t, gi in zip(node.inputs, input_grads):
        if isinstance(gi, SumsWritten):  # it wrote the gradient of t's producer's bias too
            bias = _bias_of(t._node)
            bias.grad_is_zero = bias.grad_unfilled = False
            sweep.bias_written.add(id(t._node))
            gi = gi.grad
        if gi is WROTE:  # the VJP wrote it into t.grad itself
            t.grad_is_zero = t.grad_unfilled = False
            continue
        if isinstance(gi, Summed):  # the VJP added the pending gradient into its own
            grads[id(t._node)] = gi.array
            continue
        if gi is None or not t.requires_grad:
            continue
        if t._node is None:
            t._accumulate_grad(gi)
        elif id(t._node) in grads:
            key = id(t._node)
            grads[key] = grads[key] + gi  # not in place: a VJP may return shared arrays
        else:
            grads[id(t._node)] = gi
