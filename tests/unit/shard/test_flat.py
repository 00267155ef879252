"""FlatLayout: shard ranges disjoint and covering, views, pieces, decay segments (property-based)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpifsdp.shard.flat import FlatLayout

shapes = st.lists(st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, world=st.integers(1, 8))
def test_shards_partition_the_padded_vector(shapes, world):
    layout = FlatLayout(tuple(f"t{i}" for i in range(len(shapes))), tuple(shapes), np.float32, world)
    numel = sum(math.prod(s) for s in shapes)
    assert layout.numel == numel
    assert layout.padded_numel % world == 0 and 0 <= layout.padded_numel - numel < world
    ranges = [layout.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, disjoint, covering

    # every tensor element lands in exactly one rank's pieces, at the right place
    flat = np.arange(layout.padded_numel, dtype=np.float64)
    views = layout.views(flat)
    covered = {name: np.zeros(v.size, dtype=int) for name, v in views.items()}
    for r in range(world):
        lo, _ = layout.shard_range(r)
        for name, t0, t1, s0 in layout.pieces_in_shard(r):
            covered[name][t0:t1] += 1
            np.testing.assert_array_equal(views[name].reshape(-1)[t0:t1], flat[lo + s0 : lo + s0 + t1 - t0])
    assert all((c == 1).all() for c in covered.values())

    # decay segments: exactly the elements of tensors with ndim >= 2
    decayed = sum(stop - start for r in range(world) for start, stop in layout.decay_segments(r))
    assert decayed == sum(math.prod(s) for s in shapes if len(s) >= 2)


def test_views_share_memory_and_fingerprint():
    layout = FlatLayout(("a", "b"), ((2, 3), (4,)), np.float32, 3)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (10, 12, 4)
    flat = np.zeros(12, dtype=np.float32)
    layout.views(flat)["b"][:] = 7
    assert flat.tolist() == [0] * 6 + [7] * 4 + [0, 0]
    other = FlatLayout(("a", "b"), ((3, 2), (4,)), np.float32, 3)
    assert layout.fingerprint() != other.fingerprint()
    assert layout.fingerprint() == FlatLayout(("a", "b"), ((2, 3), (4,)), np.float32, 3).fingerprint()


def test_layout_errors():
    with pytest.raises(ValueError, match="duplicate tensor names"):
        FlatLayout(("a", "a"), ((1,), (2,)), np.float32, 1)
    with pytest.raises(TypeError, match="one dtype"):
        FlatLayout.of([("a", np.zeros(2, np.float32)), ("b", np.zeros(2, np.float64))], 2)
    with pytest.raises(ValueError, match="expects|flat vector of 4"):
        FlatLayout(("a",), ((3,),), np.float32, 2).views(np.zeros(3))
    with pytest.raises(ValueError, match="rank 2 outside world of size 2"):
        FlatLayout(("a",), ((3,),), np.float32, 2).shard_range(2)
