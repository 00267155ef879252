"""shard/exact.py: the fixed-point sums of deterministic mode, against float64 (and exact) sums."""

import math
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI

from mpifsdp import Comm
from mpifsdp.shard.exact import LEVEL_STEP, MAX_CHUNKS, ExactSum, exact_squared_norm, level_of


def _alone():
    return Comm(MPI.COMM_SELF, threads=None)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_sum_of_chunks_is_the_true_sum_to_the_dtypes_precision(dtype):
    """Chunks of magnitudes 1e-3..1e3 (float16: 1e-2..1e2), weighted: the fixed-point total equals the
    exactly computed sum (Fractions) within the rounding the levels allow, and is the same in any order."""
    rng = np.random.default_rng(0)
    spread = 2 if dtype == np.float16 else 3
    chunks = [
        (rng.standard_normal(50) * 10.0 ** rng.integers(-spread, spread + 1)).astype(dtype) for _ in range(9)
    ]
    weights = [int(w) for w in rng.integers(1, 300, len(chunks))]
    truth = [sum(Fraction(float(c[i])) * w for c, w in zip(chunks, weights)) for i in range(50)]
    totals = []
    for order in (range(9), reversed(range(9)), [4, 1, 7, 0, 8, 2, 6, 3, 5]):
        exact = ExactSum(50, np, dtype)
        for i in order:
            exact.add(chunks[i], weights[i])
        total, weight = exact.reduce_scatter(_alone(), 50, unit="u", phase="backward")
        assert weight == sum(weights)
        totals.append(total.tobytes())
    assert len(set(totals)) == 1  # the order of the chunks does not show
    largest = max(float(np.abs(c).max()) * w for c, w in zip(chunks, weights))
    rounding = largest * 2.0 ** -(45 if dtype != np.float64 else 95)  # per chunk, at its level (docs)
    error = max(abs(float(t) - float(x)) for t, x in zip(np.frombuffer(totals[0]), truth))
    assert error <= len(chunks) * rounding + 2 * np.finfo(np.float64).eps * largest * len(chunks)


@pytest.mark.parametrize("scale", [1e-280, 1e-300, 1e-310, 5e-324, 1e300])
def test_chunks_at_the_edges_of_float64s_range_add_exactly(scale):
    """A float64 chunk gradient below ~1e-293 raised a bare OverflowError (2**level is no float), and
    once that was caught the mean was garbage (the chunk counted, its buffers never written).
    Subnormals included, the total is the exact sum, rounded once, and a chunk counts once added."""
    rng = np.random.default_rng(1)
    chunks = [rng.standard_normal(40) * scale, rng.standard_normal(40) * scale * 0.3]
    chunks[0][:3] = [5e-324, -5e-324, 0.0]  # the smallest subnormals beside the rest
    exact = ExactSum(40, np, np.float64)
    for chunk, weight in zip(chunks, (1, 3)):
        exact.add(chunk, weight)
    total, weight = exact.reduce_scatter(_alone(), 40, unit="u", phase="backward")
    truth = [Fraction(float(a)) + 3 * Fraction(float(b)) for a, b in zip(*chunks)]
    assert weight == 4 and np.isfinite(total).all()
    # Per element: each weighted element's float64 product (eps of it), each chunk's fixed point
    # (2**-95 of its largest weighted element, docs), the total's rounding to float64 (eps of it, or
    # half the smallest subnormal).
    eps, tops = (
        Fraction(2) ** -53,
        [max(abs(Fraction(float(v))) * w for v in c) for c, w in zip(chunks, (1, 3))],
    )
    for i, (t, x) in enumerate(zip(total, truth)):
        bound = eps * (abs(Fraction(float(chunks[0][i]))) + 3 * abs(Fraction(float(chunks[1][i]))) + abs(x))
        bound += sum(tops) * Fraction(2) ** -95 + Fraction(5e-324)
        assert abs(Fraction(float(t)) - x) <= bound, (i, float(t), float(x))


def test_a_chunk_whose_addition_failed_is_not_counted_and_leaves_no_garbage(monkeypatch):
    import mpifsdp.shard.exact as exact_module

    exact = ExactSum(4, np, np.float64)
    exact.add(np.ones(4))

    def fails(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(exact_module, "_add_limbs", fails)
    with pytest.raises(MemoryError):
        exact.add(np.full(4, 1e-3))
    total, weight = exact.reduce_scatter(_alone(), 4, unit="u", phase="backward")
    assert weight == 1 and np.isnan(total).all()  # refused as non-finite, never a wrong number


def test_a_nonfinite_chunk_makes_the_total_nan_and_too_many_chunks_are_refused():
    exact = ExactSum(4, np)
    exact.add(np.array([1.0, np.inf, 0, 0], np.float32))
    exact.add(np.ones(4, np.float32))
    total, _ = exact.reduce_scatter(_alone(), 4, unit="u", phase="backward")
    assert np.isnan(total).all()
    exact.chunks = MAX_CHUNKS + 1
    with pytest.raises(ValueError, match=f"more than {MAX_CHUNKS}"):
        exact.reduce_scatter(_alone(), 4, unit="u", phase="backward")


def test_the_exact_squared_norm_is_the_true_one_and_ignores_how_vectors_are_cut():
    rng = np.random.default_rng(1)
    v = (rng.standard_normal(3000) * 10.0 ** rng.integers(-4, 2, 3000)).astype(np.float32)
    truth = math.fsum(float(x) ** 2 for x in v)
    whole = exact_squared_norm(_alone(), [v])
    cut = exact_squared_norm(_alone(), [v[:1234], v[1234:2000], v[2000:]])
    assert whole == cut and abs(whole - truth) <= 2.0**-50 * float(np.abs(v).max()) ** 2 * len(v)
    assert math.isnan(exact_squared_norm(_alone(), [np.array([np.nan, 1.0])]))
    # a NaN in a later vector (a later unit's gradient shard): NaN too, not lost to max()'s order
    assert math.isnan(exact_squared_norm(_alone(), [np.ones(3), np.array([1.0, np.nan])]))
    assert exact_squared_norm(_alone(), [np.array([np.inf, 1.0])]) == math.inf


def _chunks_on_two_levels(n_coarse: int, n_fine: int, numel: int):
    """Chunks one LEVEL_STEP apart: all-3.9 ones (largest < 4: level 48, |q| ~ 2**50, the top of
    the headroom) and all-0.2 ones (level 52)."""
    coarse, fine = np.full(numel, 3.9, np.float32), np.full(numel, 0.2, np.float32)
    assert level_of(3.9) + LEVEL_STEP == level_of(0.2)
    return [coarse] * n_coarse + [fine] * n_fine


def test_chunks_on_adjacent_levels_are_reduced_as_one_with_the_same_bits_at_any_n(comm):
    """Levels differing between chunks (on one rank, or across ranks) are shifted to the finest:
    one integer reduce-scatter a unit, as with a single level (bytes 2x a float32 one, not 4x), and
    the total is the same bits whichever ranks held which chunks."""
    numel = 120  # divisible by 1..4 ranks
    rng = np.random.default_rng(2)
    scale = np.repeat(rng.standard_normal(numel // 4).astype(np.float32), 4)
    chunks = [c * scale / 4 for c in _chunks_on_two_levels(5, 7, numel)]

    def total(on, mine):
        exact = ExactSum(numel, np)
        for i in mine:
            exact.add(chunks[i], weight=i + 1)
        pending = exact.start_reduce_scatter(on, numel // on.size, unit="u", phase="backward")
        assert len(pending.parts) == 1  # one level reduced, not two
        shard, _ = pending.finish()
        return np.concatenate(on.allgather_object(shard))

    alone = total(_alone(), range(len(chunks)))
    spread = total(comm, range(comm.rank, len(chunks), comm.size))
    assert spread.tobytes() == alone.tobytes()
    truth = [sum(Fraction(float(c[i])) * (k + 1) for k, c in enumerate(chunks)) for i in range(numel)]
    largest = max(float(np.abs(c).max()) * (k + 1) for k, c in enumerate(chunks))
    assert max(abs(float(t) - float(x)) for t, x in zip(alone, truth)) <= len(chunks) * largest * 2.0**-45


def test_levels_are_not_merged_past_the_int64_headroom():
    """600 chunks at the top of the coarse level, shifted 4 bits, would pass 2**63 and wrap: they
    keep their own level (two reductions) and the total stays exact."""
    chunks = _chunks_on_two_levels(600, 1, 8)
    exact = ExactSum(8, np)
    for chunk in chunks:
        exact.add(chunk)
    pending = exact.start_reduce_scatter(_alone(), 8, unit="u", phase="backward")
    assert len(pending.parts) == 2
    total, _ = pending.finish()
    assert total.tolist() == [600 * float(np.float32(3.9)) + float(np.float32(0.2))] * 8


def test_chunks_of_either_sign_at_the_top_of_a_level_add_exactly_in_any_order():
    """Fixed point through ROUNDING_OFFSET: 40 float64 chunks of either sign at the top of one level
    (|q| ~ 2**50, whose float64 sums past 2**53 would round, by order) give the exact integer total,
    in any order; an offset whose binade did not hold the negative values would turn them wrongly."""
    rng = np.random.default_rng(3)
    chunks = [rng.uniform(2.0, 3.9, 6) * rng.choice([-1.0, 1.0], 6) for _ in range(40)]
    assert len({level_of(float(abs(c).max())) for c in chunks}) == 1
    assert min(c.min() for c in chunks) < 0 < max(c.max() for c in chunks)
    truth = [sum(Fraction(float(c[i])) for c in chunks) for i in range(6)]
    bound = 40 * 3.9 * 2.0**-95 + 2.0**-52 * float(max(abs(t) for t in truth))  # the limbs', then float64's
    totals = set()
    for order in (range(40), reversed(range(40)), rng.permutation(40)):
        exact = ExactSum(6, np, np.float64)
        for i in order:
            exact.add(chunks[i])
        total, _ = exact.reduce_scatter(_alone(), 6, unit="u", phase="backward")
        totals.add(total.tobytes())
        assert max(abs(Fraction(float(t)) - x) for t, x in zip(total, truth)) <= bound
    assert len(totals) == 1
