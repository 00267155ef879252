"""BufferPool: the flat buffers gathered parameters and gradients live in, reused across units and steps."""

from __future__ import annotations

import numpy as np


class BufferPool:
    """Flat buffers reused across units and steps: no large allocation (and page faults) per step.

    Every buffer has `size` elements (set by the owner to the largest unit), so any free buffer
    serves any unit; the pool grows only to the number of buffers in use at once.
    """

    def __init__(self, size: int = 0):
        self.size = size
        self._free: dict = {}  # dtype -> list of free buffers
        self.nbytes = 0  # physical bytes the pool holds

    def take(self, numel: int, dtype, xp, zero: bool = False):
        free = self._free.setdefault(np.dtype(dtype), [])
        buf = next((b for b in free if b.size >= numel), None)
        if buf is None:
            buf = xp.empty(max(numel, self.size), dtype=dtype)
            self.nbytes += buf.nbytes
        else:
            free.remove(buf)
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
