"""LayerNorm as raw GPU kernels: the forward in one launch, the backward in one.

fused.py's LayerNorm is eight array passes forward and about fourteen backward, each a launch and a
trip through device memory on a GPU. Here the forward gives each row a warp (its sums by shuffles,
no block barrier: a block a row, with two block-wide reductions, took about 3.5 times the
LayerNorms' traffic's time, bench/HISTORY.md), reads the row twice (its mean,
then the variance about it: the CPU's two-pass formula) and writes the output once (kept for
backward: a GPU recomputes none, cuda/fused.py). The backward kernel gives each thread
block a run of rows: per row it forms both row sums and writes dx; each thread keeps its columns'
partial sums of g*xhat and g in shared memory, and the blocks' partials are added into dw and db in
the same launch, in two levels (base/kernels.py column_sums_done: counters of finished blocks after
a memory fence, a fixed order of additions, no second launch); where asked, the column sums of dx
too, in the same way: the gradient of the bias of the linear that made x (tape.SumsWritten), with
no reduction launch of its own.
Arithmetic in float32 for float16 and float32 (double for float64), rounded once to the element type;
the parameter gradients (dw, db, ds) stay in the arithmetic's type: a GPU gathers a unit's gradient
in float32 for 16-bit parameters (shard/unit.py), so they go into it with no rounding or cast.
Each kernel has a NumPy twin taking the same arguments (base/kernels.py TWINS).
"""

from __future__ import annotations

import enum

import numpy as np

from ..base import kernels as gk
from ..base.backend import array_module_of, to_numpy

THREADS = 256  # the backward's thread blocks
ROWS_A_BLOCK = 8  # the forward's: one warp a row
MAX_BLOCKS = 512  # thread blocks of the backward: each keeps 2 C (or 3 C) partial sums, added at the end
# in packs: blocks of C / PACK threads (128 for 1024 float16 columns); 512, the fastest of the counts
# timed (gpu_check.py columns; bench/HISTORY.md)
PACKED_BLOCKS = 512

SOURCE = gk.cuda_source(__package__, "layer_norm.cu")
KERNELS = ("layer_norm_forward", "layer_norm_backward")


class Forward(enum.IntFlag):
    """layer_norm_forward's flags (FWD_* in layer_norm.cu): what its launch asks of it."""

    BIAS = 1  # b is added
    ONES_COLUMN = 2  # out[C] = 1 in every row (the next linear's bias folded into its GEMM)
    SEED = 4  # seed = x + seed_bias (cuda/fused.py Seed)
    NEXT_BIAS = 8  # every row of biased = next_bias (the next GEMM adds its product)
    PACKED = 16  # 16-byte packs, the row held in registers where it fits


class Backward(enum.IntFlag):
    """layer_norm_backward's flags (BWD_* in layer_norm.cu)."""

    ADD = 1  # gx = dx + add (the residual path's gradient)
    BIAS_GRAD = 2  # db written
    SUMS = 4  # ds: gx's column sums written
    PACKED = 8  # 16-byte packs, a thread a pack of columns


DEFINES = gk.flag_defines(Forward, "FWD_") + gk.flag_defines(Backward, "BWD_")


def source(dtype) -> str:
    return gk.typed_source(dtype, DEFINES + SOURCE)


# -- the NumPy twins: the same arguments, float64 arithmetic ---------------------------------------


def _forward_twin(grid, block, args, shared_mem=0):
    x, w, b, out, mean, rstd, seed, seed_bias, biased, next_bias, C, ld, N, eps, flags, n = args
    C, flags = int(C), Forward(int(flags))
    x64 = x.reshape(int(n), C).astype(np.float64)
    m = x64.mean(axis=1, keepdims=True)
    r = 1 / np.sqrt(((x64 - m) ** 2).mean(axis=1, keepdims=True) + float(eps))
    y = (x64 - m) * r * w.astype(np.float64)
    rows = out.reshape(-1)[: x64.shape[0] * int(ld)].reshape(-1, int(ld))
    rows[:, :C] = y + b.astype(np.float64) if flags & Forward.BIAS else y
    if flags & Forward.ONES_COLUMN:
        rows[:, C] = 1
    if flags & Forward.SEED:
        seed.reshape(x64.shape)[...] = x64 + seed_bias.astype(np.float64)
    if flags & Forward.NEXT_BIAS:
        biased.reshape(-1, int(N))[: x64.shape[0]] = next_bias
    mean.reshape(-1)[...], rstd.reshape(-1)[...] = m[:, 0], r[:, 0]


def _backward_twin(grid, block, args, shared_mem=0):
    g, x, w, mean, rstd, gx, add, partial, dw, db, ds, done, n, C, rows_per_block, flags = args
    n, C, per, flags = int(n), int(C), int(rows_per_block), Backward(int(flags))
    g64, x64 = g.reshape(n, C).astype(np.float64), x.reshape(n, C).astype(np.float64)
    rs = rstd.reshape(n, 1).astype(np.float64)
    xh = (x64 - mean.reshape(n, 1).astype(np.float64)) * rs
    gh = g64 * w.astype(np.float64)
    mean_gh, mean_ghx = gh.mean(axis=1, keepdims=True), (gh * xh).mean(axis=1, keepdims=True)
    dx = (gh - mean_gh - xh * mean_ghx) * rs
    gx.reshape(n, C)[...] = dx + add.reshape(n, C).astype(np.float64) if flags & Backward.ADD else dx
    written = gx.reshape(n, C).astype(np.float64)  # ds sums gx as written (rounded to its type)
    kinds = 3 if flags & Backward.SUMS else 2
    parts = partial.reshape(kinds, -1, C)
    for k in range(parts.shape[1]):
        rows = slice(k * per, min(n, (k + 1) * per))
        parts[0, k], parts[1, k] = (g64[rows] * xh[rows]).sum(axis=0), g64[rows].sum(axis=0)
        if kinds == 3:
            parts[2, k] = written[rows].sum(axis=0)
    sums = parts.astype(np.float64).sum(axis=1)  # every block's partials (the kernel: in groups)
    dw[...] = sums[0]
    if flags & Backward.BIAS_GRAD:
        db[...] = sums[1]
    if flags & Backward.SUMS:
        ds[...] = sums[2]


FAMILY = gk.family(
    "fused LayerNorm",
    source,
    KERNELS,
    dict(layer_norm_forward=_forward_twin, layer_norm_backward=_backward_twin),
)


# -- launching -------------------------------------------------------------------------------------


def _kernels(*arrays, stats=()):
    """The compiled kernels for these arrays and the rows' statistics, or None where they cannot run:
    not one float dtype (the statistics in its accumulator's: float32 for 16-bit rows), not
    contiguous (the caller then runs its array-module passes)."""
    dtype = arrays[0].dtype.type
    usable = dtype in gk.ELEMENT_TYPES and all(
        a.dtype == arrays[0].dtype and a.flags.c_contiguous for a in arrays if a is not None
    )
    usable = usable and all(s.dtype == gk.accumulator(dtype) and s.flags.c_contiguous for s in stats)
    if not usable:
        return None
    return FAMILY.compiled(array_module_of(arrays[0]), dtype)


def _forward(
    kernels,
    x2,
    w,
    b,
    out,
    mean,
    rstd,
    eps,
    ones_column=False,
    seed=None,
    seed_bias=None,
    biased=None,
    next_bias=None,
):
    n, C = x2.shape
    flags = (Forward.BIAS if b is not None else 0) | (Forward.ONES_COLUMN if ones_column else 0)
    flags |= (Forward.SEED if seed is not None else 0) | (Forward.NEXT_BIAS if biased is not None else 0)
    acc = gk.accumulator(x2.dtype.type)
    absent = x2  # an argument a flag leaves unread
    args = (x2, w, w if b is None else b, out, mean, rstd, absent if seed is None else seed)
    args += (w if seed_bias is None else seed_bias, absent if biased is None else biased)
    args += (w if next_bias is None else next_bias,)
    N = 0 if biased is None else biased.shape[1]
    if gk.in_packs(x2.dtype, (C, out.shape[1], N), x2, w, b, out, seed, seed_bias, biased, next_bias):
        flags |= Forward.PACKED
    sizes = (np.int32(C), np.int32(out.shape[1]), np.int32(N), acc(eps), np.int32(flags), np.int32(n))
    kernels[0]((-(-n // ROWS_A_BLOCK),), (32 * ROWS_A_BLOCK,), args + sizes)


def forward(
    x2,
    w,
    b,
    eps: float,
    out,
    mean,
    rstd,
    ones_column=False,
    seed=None,
    seed_bias=None,
    biased=None,
    next_bias=None,
) -> bool:
    """out = LayerNorm(x2) * w (+ b) over rows of x2 (n, C), and each row's mean and 1/std (n, 1)
    into mean, rstd; False (nothing written) where the kernel cannot run. out is (n, C), or with
    ones_column (n, ld > C) with a 1 at column C of every row (the next linear's bias gradient comes
    out of a GEMM with that column: cuda/fused.py `_folded_grads`). seed (n, C): written x2 +
    seed_bias on the way (cuda/fused.py Seed);
    biased (n, N): every row written next_bias (the next linear's GEMM then adds its product)."""
    kernels = _kernels(x2, w, b, out, seed, seed_bias, biased, next_bias, stats=(mean, rstd))
    if kernels is None or out.shape[1] < x2.shape[1] + ones_column:
        return False
    gk.checked_once(("layer_norm_forward", x2.dtype.type), lambda: _probe(array_module_of(x2), x2.dtype))
    _forward(kernels, x2, w, b, out, mean, rstd, eps, ones_column, seed, seed_bias, biased, next_bias)
    return True


def _backward(kernels, xp, g2, x2, w, mean, rstd, gx2, gw, gb, add2, ds=None, max_blocks: int | None = None):
    n, C = x2.shape
    packed = _in_packs(C, x2.dtype, g2, x2, w, gx2, add2)
    blocks, per = gk.row_runs(n, max_blocks or (PACKED_BLOCKS if packed else MAX_BLOCKS))
    acc = gk.accumulator(x2.dtype.type)
    partial = xp.empty((3 if ds is not None else 2, blocks, C), dtype=acc)
    done = gk.column_sum_counters(xp, x2, "layer_norm_backward", blocks)
    flags = (Backward.ADD if add2 is not None else 0) | (Backward.BIAS_GRAD if gb is not None else 0)
    flags |= (Backward.SUMS if ds is not None else 0) | (Backward.PACKED if packed else 0)
    add2 = gx2 if add2 is None else add2  # not read without Backward.ADD
    args = (g2, x2, w, mean, rstd, gx2, add2, partial, gw, gw if gb is None else gb, gw if ds is None else ds)
    sizes = (np.int32(n), np.int32(C), np.int32(per), np.int32(flags))
    threads = C // gk.pack_width(x2.dtype) if packed else THREADS
    shared = 0 if packed else _shared_bytes(C, x2.dtype.type, ds is not None)
    kernels[1]((blocks,), (threads,), args + (done,) + sizes, shared_mem=shared)


def _in_packs(C: int, dtype, *arrays) -> bool:
    """Whether the backward runs in packs: a thread a pack of every row (C / PACK threads, whole
    warps, at most 1024), every array on a 16-byte boundary."""
    threads = C // gk.pack_width(dtype)
    return gk.in_packs(dtype, (C,), *arrays) and threads % 32 == 0 and threads <= 1024


def _shared_bytes(C: int, dtype, column_sums: bool) -> int:
    """The backward's shared memory out of packs: 2 C partial sums a block (dw, db), 3 C with dx's
    column sums."""
    return (3 if column_sums else 2) * C * np.dtype(gk.accumulator(dtype)).itemsize


def backward(g2, x2, w, mean, rstd, gx2, gw, gb, add2=None, ds=None) -> bool | None:
    """gx2 (n, C), gw and gb (C,; gb None without a bias) from the output's gradient g2 and the
    forward's x2 and per-row statistics, gx2 with add2 (n, C) added where given (the gradient x has
    from its other uses: no launch to add it), and ds (C,) = the column sums of gx2 where given and
    they fit (in packs, always; else in shared memory). Returns None (nothing written) where the
    kernels cannot run, else whether ds was written."""
    C, dtype = x2.shape[1], x2.dtype.type
    kernels = _kernels(g2, x2, w, gx2, add2, stats=(mean, rstd))
    fits = [_column_sums_fit(a, C, dtype) for a in (gw, gb) if a is not None]
    packed = _in_packs(C, x2.dtype, g2, x2, w, gx2, add2)
    if kernels is None or not all(fits) or not packed and _shared_bytes(C, dtype, False) > gk.SHARED_BYTES:
        return None
    usable = ds is not None and _column_sums_fit(ds, C, dtype)
    ds = ds if usable and (packed or _shared_bytes(C, dtype, True) <= gk.SHARED_BYTES) else None
    xp = array_module_of(x2)
    gk.checked_once(("layer_norm_backward", dtype), lambda: _probe(xp, x2.dtype, backward=True))
    _backward(kernels, xp, g2, x2, w, mean, rstd, gx2, gw, gb, add2, ds)
    return ds is not None


def _column_sums_fit(a, C: int, dtype) -> bool:
    """Whether the kernel can write a column-sum output (dw, db, ds) into `a`: (C,), contiguous, in
    the arithmetic's type."""
    return a.shape == (C,) and a.dtype == gk.accumulator(dtype) and a.flags.c_contiguous


# -- the check at first use --------------------------------------------------------------------------


def _probe(xp, dtype, backward: bool = False):
    """_probe_rows on rows of 96 with a 53-wide bias written (one element at a time: not a whole
    number of packs), of 256 with a 56-wide one (in packs, the forward's row held in registers, in
    every dtype), and the forward on rows of 2056 (in packs, too long to hold)."""
    wide = _probe_rows(xp, dtype, False, 2056, 56)
    return _probe_rows(xp, dtype, backward, 96, 53) + _probe_rows(xp, dtype, backward, 256, 56) + wide


def _probe_rows(xp, dtype, backward: bool, C: int, N: int):
    """Both kernels on a small problem (37 rows of C; the backward in 8 blocks of 5 rows, the last
    of 2, as a real batch runs: several rows a block, and in 37 blocks: both levels of its column
    sums, the second group short) against their twins on host copies of the same inputs; the
    forward plain, and again with a ones column in rows C + 8 apart, a seed and a bias written into
    N-wide rows."""
    rng = np.random.default_rng(7)
    n = 37
    host = {
        k: rng.normal(0, 1, shape).astype(dtype)
        for k, shape in (("x", (n, C)), ("g", (n, C)), ("w", C), ("b", C), ("a", (n, C)), ("s", C))
    }
    x, g, w, b, add, seed_bias = (xp.asarray(host[k]) for k in "xgwbas")
    out, mean, rstd = xp.empty_like(x), *(xp.empty((n, 1), gk.accumulator(dtype)) for _ in range(2))
    kernels = _kernels(x, w, b, out, stats=(mean, rstd))
    padded, seed, biased = xp.empty((n, C + 8), dtype), xp.empty_like(x), xp.empty((n, N), dtype)
    _forward(kernels, x, w, b, padded, mean, rstd, 1e-5, True, seed, seed_bias, biased, b[:N])
    got = {"padded": to_numpy(padded)[:, : C + 1], "seed": seed, "biased": biased}
    _forward(kernels, x, w, b, out, mean, rstd, 1e-5)
    want = {k: np.empty(shape) for k, shape in (("out", (n, C)), ("mean", (n, 1)), ("rstd", (n, 1)))}
    want.update(padded=np.empty((n, C + 1)), seed=np.empty((n, C)), biased=np.empty((n, N)))
    inputs = (host["x"], host["w"], host["b"])
    plain = (want["out"], want["mean"], want["rstd"], None, None, None, None, C, C, 0, 1e-5, 1, n)
    _forward_twin(None, None, (*inputs, *plain))
    unused_stats = (np.empty((n, 1)), np.empty((n, 1)))
    seeds = (want["seed"], host["s"], want["biased"], host["b"][:N])
    _forward_twin(None, None, (*inputs, want["padded"], *unused_stats, *seeds, C, C + 1, N, 1e-5, 15, n))
    got.update(out=out, mean=mean, rstd=rstd)
    if backward:
        stats = (to_numpy(mean), to_numpy(rstd))  # the twin reads the device's statistics
        reference = _backward_reference(host["g"], host["x"], host["w"], *stats, host["a"])
        for blocks in (8, n):  # 8 blocks of 5 rows; 37 of 1: two groups of column_sums_done
            gx, (gw, gb, gs) = xp.empty_like(x), (xp.empty(C, gk.accumulator(dtype)) for _ in range(3))
            _backward(kernels, xp, g, x, w, mean, rstd, gx, gw, gb, add, gs, max_blocks=blocks)
            got.update({f"{k} in {blocks} blocks": v for k, v in dict(gx=gx, gw=gw, gb=gb, gs=gs).items()})
            want.update({f"{k} in {blocks} blocks": v for k, v in reference.items()})
    bound = {k: gk.error_bound(dtype, 4 * n, float(np.max(np.abs(v)))) for k, v in want.items()}
    for k in [k for k in bound if k.startswith("gs")]:  # a sum of n elements of gx, each within its bound
        bound[k] = n * bound[k.replace("gs", "gx", 1)]
    return [(f"{k} (rows of {C})", to_numpy(got[k]), want[k], bound[k]) for k in want]


def _backward_reference(g, x, w, mean, rstd, add) -> dict:
    """gx (+ add), gw, gb and gx's column sums in float64 through the twin (one block of partials)."""
    n, C = x.shape
    gx, partial, gw, gb, gs = np.empty((n, C)), np.empty((3, 1, C)), np.empty(C), np.empty(C), np.empty(C)
    _backward_twin(None, None, (g, x, w, mean, rstd, gx, add, partial, gw, gb, gs, None, n, C, n, 7))
    return {"gx": gx, "gw": gw, "gb": gb, "gs": gs}
