"""BufferPool: buffers made at the size asked for, reused smallest-first."""

import numpy as np

from mpifsdp.shard.pool import BufferPool


def test_buffers_are_made_at_the_size_asked_and_reused_smallest_first():
    """A shard's cast must take a shard's bytes, not the largest unit's (a root unit's embedding made
    every pooled buffer its size: N times a shard at N ranks), and a freed buffer serves the next
    request it fits, the smallest one first, so that a unit of the largest size finds its own."""
    pool = BufferPool()
    unit, shard = pool.take(1000, np.float32, np), pool.take(10, np.float32, np)
    assert pool.nbytes == 4 * (1000 + 10)
    pool.give(unit)
    pool.give(shard)
    again = pool.take(8, np.float32, np)
    assert again.shape == (8,) and np.shares_memory(again, shard)  # the smallest that fits
    assert np.shares_memory(pool.take(600, np.float32, np), unit)  # no new buffer where one fits
    pool.take(2000, np.float32, np)
    assert pool.nbytes == 4 * (1000 + 10 + 2000)
    assert pool.take(4, np.float16, np).nbytes == 8 and pool.nbytes == 4 * 3010 + 2 * 4  # per dtype
