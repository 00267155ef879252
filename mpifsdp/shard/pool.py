"""BufferPool: the flat buffers gathered parameters and gradients live in, reused across units and steps."""

from __future__ import annotations

import numpy as np


class BufferPool:
    """Flat buffers reused across units and steps: no large allocation (and page faults) per step.

    A buffer is made at the size first asked for and then serves any request it fits, the smallest
    that fits first: units of one size (a model's blocks) share theirs, a larger unit (the root,
    with its embedding) keeps its own, and a shard's cast (a gather's send buffer, a kept cast)
    takes a shard's bytes, not a whole unit's. The pool grows only to the buffers in use at once.
    """

    def __init__(self):
        self._free: dict = {}  # dtype -> list of free buffers
        self.nbytes = 0  # physical bytes the pool holds

    def take(self, numel: int, dtype, xp, zero: bool = False):
        free = self._free.setdefault(np.dtype(dtype), [])
        fits = [i for i, b in enumerate(free) if b.size >= numel]
        if fits:
            buf = free.pop(min(fits, key=lambda i: free[i].size))
        else:
            buf = xp.empty(numel, dtype=dtype)
            self.nbytes += buf.nbytes
        view = buf[:numel]
        if zero:
            view.fill(0)
        return view

    def give(self, view):
        base = view if view.base is None else view.base
        self._free[np.dtype(base.dtype)].append(base)

    def state(self) -> tuple:
        """Which buffers are free (and the bytes held): a CUDA graph's replays put the pool back as
        its captured pass left it (fsdp/graphed.py), with the buffers it wrote kept out."""
        return {dtype: list(free) for dtype, free in self._free.items()}, self.nbytes

    def restore(self, state: tuple):
        free, self.nbytes = state
        self._free = {dtype: list(buffers) for dtype, buffers in free.items()}
