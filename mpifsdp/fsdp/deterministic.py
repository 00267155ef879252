"""Deterministic mode: training whose bits do not depend on the world size (docs/determinism.md).

The global batch is cut into chunks of `chunk_size` samples; every rank runs the forward and backward
of its own chunks one at a time (`sharded.chunks(x, y)`), so each chunk sees the same shapes, values
and dropout masks at any N (its GEMMs on `chunk_threads` BLAS threads), and each unit's gradient of
each chunk is added to an exact integer sum (shard/exact.py) instead of being reduce-scattered as
floats. The last chunk's backward reduces the sums; the optimizer's gradient norm is exact too.
Every chunk weighs its count of valid targets (a loss that divides by one: cross_entropy), or its
number of samples, so the mean is the global batch's.
"""

from __future__ import annotations

import dataclasses
import math

from ..base.threads import blas_pinned
from ..nn.layers import Dropout, drawing_for_chunk


@dataclasses.dataclass
class ChunkState:
    """What the running chunk's forward recorded, for its backward and for the exact mean loss."""

    index: int | None = None  # the chunk's position in the global batch (None: not in a chunk)
    weight: int | None = None  # its valid-target count, or its sample count
    losses: list = dataclasses.field(default_factory=list)  # (index, weight, loss) of this batch

    def count(self, local: int) -> int:
        """ops.mean_over_ranks in a chunk: the chunk's loss is its own mean, weighed by `local`."""
        self.weight = int(local)
        return local


class ChunkedBatch:
    """This rank's chunks of its batch, one at a time: `for x_c, y_c in batch: model(x_c, y_c).backward()`.

    Gradient sync is on for the last chunk only (as under no_sync: the user's own setting still
    decides whether that one reduces), dropout draws by the chunk's global position, and
    `mean_loss()` afterwards gives the global batch's mean loss with the same bits at any N."""

    def __init__(self, sharded, arrays):
        self.sharded, self.arrays = sharded, arrays
        size = sharded.chunk_size
        rows = {int(a.shape[0]) for a in arrays if getattr(a, "ndim", 0) > 0}
        if len(rows) != 1 or next(iter(rows)) % size:
            raise ValueError(
                f"chunks(): the arrays' first dimensions {sorted(rows)} must be one batch size, a multiple "
                f"of chunk_size={size}"
            )
        self.count = next(iter(rows)) // size
        mine = (self.count, size, sharded.chunk_threads)
        everyone = sharded.comm.gather_ints(*mine, phase="forward", op="chunk_count").tolist()
        counts = [c for c, *_ in everyone]
        if len(set(counts)) > 1:
            raise ValueError(
                f"ranks hold different numbers of chunks {dict(enumerate(counts))}: give every rank the same "
                "number of samples (data.rank_slice splits a global batch evenly)"
            )
        settings = {(s, t) for _, s, t in everyone}
        if len(settings) > 1:  # each rank's chunks would round as its own settings do
            raise ValueError(
                f"ranks have different (chunk_size, chunk_threads) {sorted(settings)}: pass fully_shard the "
                "same on every rank"
            )
        self.first = sharded.comm.rank * self.count  # the batch is split by rank, in rank order

    def __iter__(self):
        sharded, size, state = self.sharded, self.sharded.chunk_size, self.sharded.chunk_state
        dropouts = [m for _, m in sharded.model_modules() if isinstance(m, Dropout)]
        start = [d._calls for d in dropouts]
        user_sync = sharded.requires_gradient_sync
        state.losses = []
        try:
            with blas_pinned(sharded.chunk_threads):  # a chunk's GEMMs' bits depend on the thread count
                for j in range(self.count):
                    for d, calls in zip(dropouts, start):
                        d._calls = calls  # every chunk draws as the first: masks differ by position only
                    sharded.requires_gradient_sync = user_sync and j == self.count - 1
                    state.index = self.first + j
                    with drawing_for_chunk(state.index):
                        yield tuple(a[j * size : (j + 1) * size] for a in self.arrays)
        finally:
            sharded.requires_gradient_sync = user_sync
            state.index = None

    def mean_loss(self) -> float:
        """The global batch's mean loss (collective): the chunks' losses weighed by their counts,
        summed exactly (math.fsum: correctly rounded, so in no order's favour)."""
        everyone = self.sharded.comm.allgather_object(self.sharded.chunk_state.losses, phase="forward")
        chunks = [c for rank in everyone for c in rank]
        total = sum(w for _, w, _ in chunks)
        return math.fsum(w * loss for _, w, loss in chunks) / total if total else math.nan


__all__ = ["ChunkState", "ChunkedBatch"]
