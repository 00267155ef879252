"""shard/exact.py: the fixed-point sums of deterministic mode, against float64 (and exact) sums."""

import math
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI

from mpifsdp import Comm
from mpifsdp.shard.exact import MAX_CHUNKS, ExactSum, exact_squared_norm


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
    assert exact_squared_norm(_alone(), [np.array([np.inf, 1.0])]) == math.inf
