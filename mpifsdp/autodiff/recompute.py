"""Activation checkpointing: a function's forward keeps only its inputs; backward runs it again.

`recompute(fn, *args)` runs fn without recording (its intermediate activations are freed as soon as
fn returns) and records ONE node whose inputs are the Tensor arguments. That node's VJP runs fn again
with recording on, then backward through the fresh graph: gradients reach the arguments (returned)
and every Param fn used (accumulated into .grad as always). Memory: the function's activations exist
only during its own backward, at the price of a second forward. The second run draws the same
random numbers as the first from the global generators: NumPy's legacy `np.random.*` and Python's
`random` are put back to their state at the first run, and restored after. A Generator object fn
holds (`np.random.default_rng(...)`) cannot be seen from here: pass a `replay` that rewinds it, as
nn.layers.draws_replay rewinds a module's dropouts and generators (fully_shard passes it).

Under FSDP (fully_shard(..., recompute=...)) the node is recorded inside its unit's scope, so the
unit's parameters are gathered for backward before the re-run, as they would be anyway: no extra
gather.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np

from .tape import Node, active_scopes, backward, fresh_recording, grad_enabled, no_grad
from .tensor import Tensor


class _Recomputed:
    """The primitive of one recompute() node: its VJP re-runs fn (a Node needs .name and .vjp)."""

    name = "recompute"

    def __init__(self, fn, args, replay, rng_states):
        # The Tensor arguments' places and flags only: holding the Tensors would keep the graph
        # upstream alive through the whole backward (the node's inputs hold them until its VJP ran).
        self.fn, self.replay, self.rng_states = fn, replay, rng_states
        self.template = [("tensor", a.requires_grad) if isinstance(a, Tensor) else ("value", a) for a in args]

    def vjp(self, g, saved, *arrays):
        fresh = iter(arrays)  # new leaves in place of the Tensor arguments, same values and flags
        args = [Tensor(next(fresh), kept) if kind == "tensor" else kept for kind, kept in self.template]
        with fresh_recording(), self.replay(), _global_rngs_at(self.rng_states):
            out = self.fn(*args)
        if out._node is not None:  # else nothing inside depended on a gradient-carrying value
            backward(out, g)
        return tuple(a.grad for a in args if isinstance(a, Tensor))


def recompute(fn, *args, replay=contextlib.nullcontext):
    """fn(*args) -> Tensor, keeping only the Tensor arguments for backward (see the module docstring).

    Non-Tensor arguments are passed as they are, to both runs. replay(): a context manager the second
    run happens inside (to replay random draws)."""
    if not grad_enabled():
        return fn(*args)
    rng_states = (np.random.get_state(), random.getstate())  # what the first run draws from
    with no_grad():
        out = fn(*args)
    if not isinstance(out, Tensor):
        raise TypeError(f"recompute: the function must return one Tensor, got {type(out).__name__}")
    inputs = tuple(a for a in args if isinstance(a, Tensor))
    result = Tensor(out.data, requires_grad=True)
    result._node = Node(_Recomputed(fn, args, replay, rng_states), inputs, None, {}, active_scopes())
    return result


@contextlib.contextmanager
def _global_rngs_at(states):
    """Inside: NumPy's and Python's global generators at `states`; after: where they were."""
    now = (np.random.get_state(), random.getstate())
    np.random.set_state(states[0])
    random.setstate(states[1])
    try:
        yield
    finally:
        np.random.set_state(now[0])
        random.setstate(now[1])
