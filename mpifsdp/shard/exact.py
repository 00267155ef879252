"""Exact, order-independent sums of floating-point chunks: the deterministic mode's arithmetic.

A float sum depends on its grouping, so the sum of the same chunk gradients over 2 ranks and over 3
differs in its last bits. Integers do not: each chunk's gradient g is turned into int64 fixed point
at a level L of its own, q = rint(g * 2**L), with L a function of max|g| alone (so the same chunk
gives the same q on any rank, at any world size), and chunks are added as integers, by this rank and
then by MPI's integer reduce-scatter. The level leaves room for `MAX_CHUNKS` chunks of the largest
magnitude (|q| <= 2**62 / MAX_CHUNKS), and levels are multiples of LEVEL_STEP, so chunks of similar
size share one int64 buffer; each level used is one buffer and one reduction (usually one level per
unit: 8 bytes per element, twice a float32 reduce-scatter). The total is sum_L q_L * 2**-L, converted
level by level in ascending order. Relative to each chunk's largest element the rounding is
2**-(62 - log2 MAX_CHUNKS - LEVEL_STEP) ~ 2**-46, below float32's precision; a float64 chunk keeps a
second limb for the remainder (2**-96: 16 bytes per element, twice a float64 reduce-scatter), so
that Adam, which divides each element by its own size, sees float64's precision. Either way the
rounding is a deterministic function of the chunk, which is all that same-bits-at-any-N needs.
"""

from __future__ import annotations

import math

import numpy as np

from ..base.backend import array_module_of, to_numpy

MAX_CHUNKS = 2**12  # chunks one sum may hold: 4096 sequences of one, at 4 bytes/element of headroom
LEVEL_STEP = 4  # levels are multiples of this many bits
TOP_BITS = 62 - int(math.log2(MAX_CHUNKS))  # |q| of one chunk stays below 2**TOP_BITS
LOW_BITS = TOP_BITS - 1  # the second limb of a float64 chunk: |remainder| * 2**LOW_BITS <= 2**(TOP_BITS - 2)


def _limbs(xp, scaled, two: bool) -> list:
    """int64 fixed point of `scaled` (|scaled| <= 2**TOP_BITS): rint(scaled), and with two=True the
    remainder (|r| <= 1/2, exact in float64) at LOW_BITS more bits, so a float64 chunk keeps its
    precision relative to its smaller elements too (2**-96 of its largest, not 2**-46)."""
    high = xp.rint(scaled)
    if not two:
        return [high.astype(np.int64)]
    low = xp.rint(xp.ldexp(scaled - high, LOW_BITS))
    return [high.astype(np.int64), low.astype(np.int64)]


def level_of(largest: float) -> int:
    """The fixed-point level of a chunk whose largest magnitude is `largest` (> 0, finite)."""
    exponent = math.frexp(largest)[1]  # largest < 2**exponent
    return LEVEL_STEP * ((TOP_BITS - exponent) // LEVEL_STEP)


class ExactSum:
    """The chunks added so far of one flat vector (a unit's full gradient), as int64 per level.

    `add` is local; `reduce_scatter` is the collective that sums every rank's chunks exactly and
    leaves this rank's shard of the total. A NaN or Inf in any chunk on any rank makes the whole
    total NaN on every rank (the optimizer's non-finite policy then applies), never a wrapped integer."""

    def __init__(self, numel: int, xp, dtype=np.float32):
        """dtype: the chunks' (float64 takes two int64 limbs per element, narrower types one)."""
        self.numel, self.xp = numel, xp
        self.limbs = 2 if np.dtype(dtype) == np.float64 else 1
        self.levels: dict[int, list] = {}  # level -> its limbs, int64 buffers of numel
        self.nonfinite = False
        self.weight = self.chunks = 0  # the weights given with the chunks, summed (integers: exact)

    def add(self, chunk, weight: int = 1):
        """Add `weight` * chunk (a flat float array of numel), exactly; weight: an integer >= 0 (the
        chunk's count of targets, or of rows), the same for the same chunk at any N."""
        largest = float(abs(chunk).max()) if chunk.size else 0.0
        self.weight += weight
        self.chunks += 1
        if not math.isfinite(largest) or not math.isfinite(largest * weight):
            self.nonfinite = True
            return
        if largest == 0.0 or weight == 0:
            return
        scaled = chunk * weight if weight != 1 else chunk  # a float product: the same bits for the same chunk
        level = level_of(largest * weight)
        limbs = _limbs(self.xp, self.xp.ldexp(scaled.astype(np.float64), level), chunk.dtype == np.float64)
        if level in self.levels:
            for total, limb in zip(self.levels[level], limbs):
                total += limb
        else:
            self.levels[level] = limbs

    def reduce_scatter(self, comm, shard_numel: int, replicas=None, *, unit: str, phase: str):
        """Collective: (this rank's float64 slice of the total over every rank's chunks, and over
        the groups' with replicas; the total weight, an integer). Empties the sum."""
        mine = (sorted(self.levels), self.nonfinite, self.weight, self.chunks)
        everyone = comm.allgather_object(mine, phase=phase)
        if replicas is not None:
            everyone = [e for group in replicas.allgather_object(everyone, phase=phase) for e in group]
        chunks = sum(c for *_, c in everyone)
        if chunks > MAX_CHUNKS:  # the same count on every rank: all raise
            raise ValueError(
                f"unit {unit!r}: {chunks} chunks in one exact sum, more than {MAX_CHUNKS} (the int64 "
                "headroom): use larger chunks, or reduce more often"
            )
        total = self.xp.zeros(shard_numel, dtype=np.float64)
        for level in sorted({level for used, *_ in everyone for level in used}):  # ascending, at every N
            for limb, full in enumerate(self.levels.get(level) or [None] * self.limbs):
                full = self.xp.zeros(self.numel, dtype=np.int64) if full is None else full
                part = self.xp.empty(shard_numel, dtype=np.int64)
                comm.reduce_scatter(full, part, unit=unit, phase=phase)
                if replicas is not None:
                    replicas.all_reduce(part, unit=unit, phase=phase)
                total += self.xp.ldexp(part.astype(np.float64), -level - LOW_BITS * limb)
        if any(bad for _, bad, *_ in everyone):
            total[...] = np.nan
        self.levels.clear()
        self.nonfinite, self.weight, self.chunks = False, 0, 0
        return total, sum(w for _, _, w, _ in everyone)


def exact_squared_norm(comm, vectors) -> float:
    """Sum over ranks of sum(v * v) of this rank's `vectors`, independent of how they are cut into
    shards: each square becomes int64 fixed point at a level set by the global largest one (a max is
    exact), and the ranks' integer sums are added as Python integers. Collective (two exchanges)."""
    vectors = [v for v in vectors if v is not None and v.size]
    largest = max((float(abs(v).max()) for v in vectors), default=0.0)
    everyone = comm.allgather_object(largest, phase="optimizer")
    if any(math.isnan(x) for x in everyone):  # max() over a NaN depends on the order
        return math.nan
    top = max(everyone)
    if math.isinf(top):
        return math.inf
    if top == 0.0:
        return 0.0
    # every square < 2**(2e): below 2**41 at this level, its remainder kept at 20 more bits, and
    # slices of 2**20 summed in int64 (< 2**61); the ranks' sums meet as Python integers
    level, slice_ = 41 - 2 * math.frexp(top)[1], 2**20
    partial = 0
    for v in vectors:
        xp = array_module_of(v)
        wide = v.astype(np.float64)
        scaled = xp.ldexp(wide * wide, level)
        high = xp.rint(scaled)
        low = xp.rint(xp.ldexp(scaled - high, 20)).astype(np.int64)
        high = high.astype(np.int64)
        for start in range(0, v.size, slice_):
            part = slice(start, start + slice_)
            partial += int(to_numpy(high[part].sum())) * 2**20 + int(to_numpy(low[part].sum()))
    total = sum(comm.allgather_object(partial, phase="optimizer"))  # Python ints: exact
    return math.ldexp(float(total), -level - 20)


__all__ = ["ExactSum", "exact_squared_norm", "level_of"]
