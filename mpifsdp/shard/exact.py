"""Exact, order-independent sums of floating-point chunks: the deterministic mode's arithmetic.

A float sum depends on its grouping, so the sum of the same chunk gradients over 2 ranks and over 3
differs in its last bits. Integers do not: each chunk's gradient g is turned into int64 fixed point
at a level L of its own, q = rint(g * 2**L), with L a function of max|g| alone (so the same chunk
gives the same q on any rank, at any world size), and chunks are added as integers, by this rank and
then by MPI's integer reduce-scatter. The level leaves room for `MAX_CHUNKS` chunks of the largest
magnitude (|q| <= 2**62 / MAX_CHUNKS), and levels are multiples of LEVEL_STEP, so chunks of similar
size share one int64 buffer. Where the chunks' levels differ (on one rank or across ranks) and the
chunk count leaves the headroom, the coarser levels are shifted to the finest before the reduction:
one buffer and one reduction a unit (8 bytes per element, twice a float32 reduce-scatter);
otherwise one per level. The total is sum_L q_L * 2**-L, converted level by level in ascending
order. Relative to each chunk's largest element the rounding is
2**-(62 - log2 MAX_CHUNKS - LEVEL_STEP) ~ 2**-46, below float32's precision; a float64 chunk keeps a
second limb for the remainder (2**-96: 16 bytes per element, twice a float64 reduce-scatter), so
that Adam, which divides each element by its own size, sees float64's precision. Either way the
rounding is a deterministic function of the chunk, which is all that same-bits-at-any-N needs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..base.backend import array_module_of, pieces, to_numpy

MAX_CHUNKS = 2**12  # chunks one sum may hold: 4096 sequences of one, at 4 bytes/element of headroom
LEVEL_STEP = 4  # levels are multiples of this many bits
TOP_BITS = 62 - int(math.log2(MAX_CHUNKS))  # |q| of one chunk stays below 2**TOP_BITS
BLOCK = 1 << 16  # elements converted at a time on the CPU: 512 KiB of float64 scratch, in cache
SPLIT_LEVEL = 960  # a level above it scales a chunk in two products: 2**level itself is no float64
LOW_BITS = TOP_BITS - 1  # the second limb of a float64 chunk: |remainder| * 2**LOW_BITS <= 2**(TOP_BITS - 2)
# x + ROUNDING_OFFSET, for |x| < 2**51, lands in [2**52, 2**53), where float64's spacing is 1: the add
# rounds x to an integer (to nearest, ties to even, as rint) and the sum's bits are OFFSET_BITS + rint(x),
# so an int64 subtraction of the bits turns it int64, without a float-to-int conversion (the slowest pass)
ROUNDING_OFFSET = 1.5 * 2**52
OFFSET_BITS = int(np.float64(ROUNDING_OFFSET).view(np.int64))


_scratch: dict = {}  # (array module, dtype) -> the largest scratch vector asked for so far


def scratch(xp, numel: int, dtype, which: int = 0):
    """A reused vector of numel (not zeroed): the conversions below run in place in it, not in a
    fresh allocation per chunk (one per array module, dtype and `which`; single-threaded use)."""
    key = (xp.__name__, np.dtype(dtype).str, which)
    buffer = _scratch.get(key)
    if buffer is None or buffer.size < numel:
        buffer = _scratch[key] = xp.empty(numel, dtype=dtype)
    return buffer[:numel]


def _add_limbs(xp, chunk, factor: float, limbs: list, two: bool, first: bool, rest: int = 0) -> list:
    """Add the fixed point of chunk * factor (|.| <= 2**TOP_BITS) into `limbs` (first: write them):
    rint of it, and with two=True the remainder (|r| <= 1/2, exact in float64) at LOW_BITS more
    bits, so a float64 chunk keeps its precision relative to its smaller elements too (2**-96 of its
    largest, not 2**-46). One product (exact for float32 and float16 chunks: 24 bits times an integer
    weight times a power of two), then in place, a cache-sized block at a time on the CPU
    (elementwise: the blocks change no bit). rest: a further 2**rest, for a chunk so small (below
    ~2**-970) that its level's factor exceeds float64's range: the first product is then normal and
    the second exact."""
    for start, stop in blocks(xp, chunk.size):
        n = stop - start
        scaled = xp.multiply(chunk[start:stop], factor, out=scratch(xp, n, np.float64), dtype=np.float64)
        if rest:
            scaled *= 2.0**rest
        parts = [scaled]
        if two:
            high = xp.rint(scaled, out=scratch(xp, n, np.float64, which=1))
            scaled -= high
            scaled *= 2.0**LOW_BITS
            parts = [high, scaled]
        for total, part in zip(limbs, parts):
            _add_rounded(xp, total[start:stop], part, first)
    return limbs


def _add_rounded(xp, total, values, first: bool):
    """total (int64) += rint(values) (float64, |.| < 2**51; first: total = rint(values)), through
    ROUNDING_OFFSET; values is scratch, overwritten."""
    values += ROUNDING_OFFSET
    whole = values.view(np.int64)
    if first:
        xp.subtract(whole, OFFSET_BITS, out=total)
    else:
        whole -= OFFSET_BITS
        total += whole


def blocks(xp, numel: int):
    """(start, stop) pieces of a vector: BLOCK elements on the CPU, so that a conversion's passes stay
    in cache; the whole vector on a GPU (backend.pieces)."""
    return pieces(xp, numel, BLOCK)


def largest_magnitude(xp, vector) -> float:
    """max |v| (NaN where any v is), reading the vector once: a cache-sized block's maximum and
    minimum at a time (0 for an empty vector)."""
    ends = []
    for start, stop in blocks(xp, vector.size):
        ends += (float(vector[start:stop].max()), -float(vector[start:stop].min()))
    return max_or_nan(ends)


def max_or_nan(values) -> float:
    """max(values), NaN where any is (Python's max keeps a NaN only where it comes first), 0.0 for
    none."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def level_of(largest: float) -> int:
    """The fixed-point level of a chunk whose largest magnitude is `largest` (> 0, finite)."""
    exponent = math.frexp(largest)[1]  # largest < 2**exponent
    return LEVEL_STEP * ((TOP_BITS - exponent) // LEVEL_STEP)


class ExactSum:
    """The chunks added so far of one flat vector (a unit's full gradient), as int64 per level.

    `add` is local; `reduce_scatter` is the collective that sums every rank's chunks exactly and
    leaves this rank's shard of the total. A NaN or Inf in any chunk on any rank makes the whole
    total NaN on every rank (the optimizer's non-finite policy then applies), never a wrapped integer."""

    def __init__(self, numel: int, xp, dtype=np.float32, buffers=None):
        """dtype: the chunks' (float64 takes two int64 limbs per element, narrower types one).
        buffers: where the int64 vectors come from and go back to, (take(numel), give(vector)): a
        Unit's pool, so that no vector of the model's size is allocated (and faulted in) each step,
        and its memory ledger counts them; default: fresh arrays."""
        self.numel, self.xp = numel, xp
        self.take, self.give = buffers or ((lambda n: xp.empty(n, dtype=np.int64)), (lambda vector: None))
        self.limbs = 2 if np.dtype(dtype) == np.float64 else 1
        self.levels: dict[int, list] = {}  # level -> its limbs, int64 buffers of numel
        self.nonfinite = False
        self.weight = self.chunks = 0  # the weights given with the chunks, summed (integers: exact)

    def add(self, chunk, weight: int = 1):
        """Add `weight` * chunk (a flat float array of numel), exactly; weight: an integer >= 0 (the
        chunk's count of targets, or of rows), the same for the same chunk at any N."""
        largest = largest_magnitude(self.xp, chunk)
        if not math.isfinite(largest) or not math.isfinite(largest * weight):
            self.nonfinite = True
        elif largest != 0.0 and weight != 0:
            level = level_of(largest * weight)  # up to ~1120 for a subnormal chunk: 2**level is no float
            first = level not in self.levels
            if first:
                self.levels[level] = [self.take(self.numel) for _ in range(self.limbs)]
            factor, rest = math.ldexp(weight, min(level, SPLIT_LEVEL)), max(level - SPLIT_LEVEL, 0)
            try:
                _add_limbs(self.xp, chunk, factor, self.levels[level], self.limbs == 2, first, rest)
            except BaseException:  # part added: the sum is no longer exact, so it is NaN, never garbage
                self.nonfinite = True
                raise
        self.weight += weight  # counted once added (a chunk that raised above is not in the sum)
        self.chunks += 1

    def release(self):
        """Give back the vectors of chunks added and not reduced (the sum is forgotten)."""
        for limbs in self.levels.values():
            for vector in limbs:
                self.give(vector)
        self.levels = {}

    def reduce_scatter(self, comm, shard_numel: int, replicas=None, *, unit: str, phase: str):
        """Collective: (this rank's float64 slice of the total over every rank's chunks, and over
        the groups' with replicas; the total weight, an integer). Empties the sum."""
        return self.start_reduce_scatter(comm, shard_numel, replicas, unit=unit, phase=phase).finish()

    def start_reduce_scatter(self, comm, shard_numel: int, replicas=None, *, unit: str, phase: str):
        """reduce_scatter, started: the levels are agreed now (one small exchange), the integer
        reduce-scatters run while the caller goes on; PendingSum.finish() completes them."""
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
        nonfinite, weight = any(bad for _, bad, *_ in everyone), sum(w for _, _, w, _ in everyone)
        pending = PendingSum(comm, replicas, unit, phase, nonfinite, weight, shard_numel, self.xp, self.give)
        # every chunk's level, whichever rank holds it: the same at any N
        levels = sorted({level for used, *_ in everyone for level in used})
        merged = merged_level(levels, chunks)
        if merged is not None:  # one vector (per limb) to reduce: bytes as with a single level
            self._shift_into(merged)
            levels = [merged]
        for level in levels:  # ascending, at every N
            for limb, full in enumerate(self.levels.get(level) or [None] * self.limbs):
                if full is None:  # a level only other ranks used: this rank adds zeros
                    full = self.take(self.numel)
                    full.fill(0)
                part = self.take(shard_numel)
                request = comm.ireduce_scatter(full, part, unit=unit, phase=phase)
                pending.parts.append((request, full, part, -level - LOW_BITS * limb))
        self.levels = {}
        self.nonfinite, self.weight, self.chunks = False, 0, 0
        return pending

    def _shift_into(self, target: int):
        """Every local level's integers shifted up to the finer level `target` and added into one
        vector per limb: exact (integers; merged_level checked the headroom), so the total is the
        same integer whichever rank held which chunk."""
        into = self.levels.pop(target, None)
        for level, limbs in self.levels.items():
            for vector in limbs:
                vector <<= target - level
            if into is None:
                into = limbs
                continue
            for total, vector in zip(into, limbs):
                total += vector
                self.give(vector)
        self.levels = {target: into}


def merged_level(levels: list, chunks: int):
    """The finest of a sum's levels where every chunk at a coarser one can be shifted to it exactly,
    or None: a shift of d bits multiplies a chunk's |q| <= 2**TOP_BITS by 2**d, so `chunks` of them
    stay in the int64 headroom while chunks * 2**d <= MAX_CHUNKS (levels one LEVEL_STEP apart, the
    usual case: up to 256 chunks). Depends on every chunk's level and the chunk count only, so the
    same at any N."""
    if len(levels) < 2 or chunks << (levels[-1] - levels[0]) > MAX_CHUNKS:
        return None
    return levels[-1]


@dataclasses.dataclass
class PendingSum:
    """Integer reduce-scatters in flight, level by level, ascending: finish() adds them up in that
    order (the same float additions at every N)."""

    comm: object
    replicas: object
    unit: str
    phase: str
    nonfinite: bool
    weight: int
    shard_numel: int
    xp: object
    give: object  # where the int64 vectors go back once their sums are read
    parts: list = dataclasses.field(default_factory=list)  # (request, full, part, exponent)

    def finish(self):
        """(this rank's float64 slice of the total; the total weight)."""
        self._wait()
        total = self.xp.empty(self.shard_numel, dtype=np.float64)
        for start, stop in blocks(self.xp, self.shard_numel):
            total[start:stop] = self._total(start, stop)
        self._give_back()
        return total, self.weight

    def add_mean_into(self, target, unfilled: bool = False) -> int:
        """target += (the total / the total weight), rounded to target's dtype, as target +=
        (finish()'s total / weight).astype(target.dtype) would, a cache-sized block at a time;
        nothing where the weight is 0. unfilled: target stands for zeros nothing wrote (a unit's
        lazily zeroed shard): the mean is written over it, with the same one rounding, so the same
        bits and no fill. Returns the total weight."""
        self._wait()
        for start, stop in blocks(self.xp, self.shard_numel) if self.weight > 0 else ():
            mean = self._total(start, stop)
            if unfilled:
                self.xp.divide(mean, self.weight, out=target[start:stop], casting="unsafe")
                continue
            mean /= self.weight
            target[start:stop] += mean.astype(target.dtype, copy=False)
        if unfilled and self.weight == 0:
            target.fill(0)
        self._give_back()
        return self.weight

    def _give_back(self):
        for _, full, part, _ in self.parts:
            self.give(full)
            self.give(part)
        self.parts = []

    def _wait(self):
        for request, _, part, _ in self.parts:
            self.comm.wait(request)
            if self.replicas is not None:
                self.replicas.all_reduce(part, unit=self.unit, phase=self.phase)

    def _total(self, start: int, stop: int):
        """Elements start:stop of the total (float64 scratch), its levels added in ascending order
        (the first written, not added to zeros: the same bits, as int64 gives no -0)."""
        total = scratch(self.xp, stop - start, np.float64, which=2)
        if self.nonfinite or not self.parts:
            total[...] = np.nan if self.nonfinite else 0.0
            return total
        (_, _, part, exponent), *finer = self.parts
        _times_power_of_two(self.xp, part[start:stop], exponent, out=total)
        for _, _, part, exponent in finer:
            total += _times_power_of_two(
                self.xp, part[start:stop], exponent, out=scratch(self.xp, stop - start, np.float64, which=3)
            )
        return total


def exact_squared_norm(comm, vectors) -> float:
    """Sum over ranks of sum(v * v) of this rank's `vectors`, independent of how they are cut into
    shards: each square becomes fixed point at a level set by the global largest one (a max is
    exact), and the ranks' integer sums are added as Python integers. Collective (two exchanges)."""
    vectors = [v for v in vectors if v is not None and v.size]
    largest = max_or_nan(float(abs(v).max()) for v in vectors)
    top = max_or_nan(comm.allgather_object(largest, phase="optimizer"))
    if math.isnan(top) or math.isinf(top):
        return top
    if top == 0.0:
        return 0.0
    # Every square < 2**(2e). At this level a square is below 2**32 and rounds to an integer, so a
    # float64 sum of 2**20 of them is exact (< 2**52); the remainder, at 20 more bits, the same way.
    # The ranks' integer sums meet as Python integers.
    level = 32 - 2 * math.frexp(top)[1]
    partial = sum(_squares_in_fixed_point(v, level) for v in vectors)
    total = sum(comm.allgather_object(partial, phase="optimizer"))  # Python ints: exact
    return math.ldexp(float(total), -level - 20)


def _squares_in_fixed_point(v, level: int) -> int:
    """sum(v * v) * 2**(level + 20) as an exact integer: each square at `level` rounded (high), and
    its remainder at 20 more bits rounded, summed exactly; a block at a time (integers: any grouping
    gives the same total)."""
    xp = array_module_of(v)
    total, step = 0, 2**20
    for start, stop in blocks(xp, v.size):
        n = stop - start
        squares = xp.multiply(v[start:stop], v[start:stop], out=scratch(xp, n, np.float64), dtype=np.float64)
        scaled = _times_power_of_two(xp, squares, level, out=squares)
        high = xp.rint(scaled, out=scratch(xp, n, np.float64, which=1))
        scaled -= high  # the remainder at 20 more bits: 2**-52 of the largest square in all
        scaled *= 2.0**20
        total += _exact_total(high, step) * 2**20 + _exact_total(xp.rint(scaled, out=scaled), step)
    return total


def _times_power_of_two(xp, values, exponent: int, out=None):
    """float64(values) * 2**exponent, exactly: a multiply (ldexp is several times slower), or ldexp
    where 2**exponent itself would leave float64's normal range."""
    if -1000 < exponent < 1000:
        return xp.multiply(values, math.ldexp(1.0, exponent), dtype=np.float64, out=out)
    return xp.ldexp(values, exponent, dtype=np.float64, out=out)


def _exact_total(integral, step: int) -> int:
    """The sum of float64 integers below 2**32, exactly: float sums of `step` of them at a time."""
    return sum(int(to_numpy(integral[i : i + step].sum())) for i in range(0, integral.size, step))


__all__ = ["ExactSum", "PendingSum", "exact_squared_norm", "level_of"]
