"""Fused passes as single CuPy kernels: the GPU twins of fused.py's GELU and of causal_attention.py's
causal softmax and its backward (base/kernels.py: what every raw kernel shares; AdamW's kernel is
adamw.py; layer_norm.py and cross_entropy.py hold the LayerNorm and
cross-entropy kernels).

On the CPU those run as several NumPy passes over cache-sized chunks; on a GPU each pass is a kernel
launch and a trip through device memory, so the same arithmetic is done in one kernel that reads
each element once. The formulas are the NumPy ones; float16 computes in float32 and rounds once (the
NumPy path rounds after every pass). tests/unit/ops/test_gpu_kernels.py holds both paths to the same float64
formulas, and the attention and parity checks to each other. Kernels are compiled by CuPy on first
use and cached; nothing here imports CuPy.
"""

from __future__ import annotations

import enum
import functools
import logging
import math

import numpy as np

from ..base.backend import array_module_of, to_numpy
from ..base.kernels import (
    ELEMENT_TYPES,
    TWINS,
    accumulator,
    checked_once,
    column_sum_counters,
    cuda_source,
    error_bound,
    family,
    flag_defines,
    in_packs,
    multiprocessors,
    pack_width,
    row_runs,
    typed_source,
)

log = logging.getLogger(__name__)

_C = math.sqrt(2.0 / math.pi)  # GELU (tanh form): u = c (x + k x^3), gelu = x sigmoid(2u)
_K = 0.044715

# GELU's sigmoid(2u) and its slope, in A: the type a kernel computes in (float for float16 and
# float32, double for float64), for the elementwise kernels and the raw one alike.
_GELU_MACROS = f"""
#define GELU_SIGMOID(x) (A(1) / (A(1) + exp(x * (A({-2 * _C!r}) + A({-2 * _C * _K!r}) * x * x))))
#define GELU_SLOPE(x, s) (s * (A(1) + x * (A({2 * _C!r}) + A({6 * _C * _K!r}) * x * x) * (A(1) - s)))
"""
_PREAMBLE = (
    """
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };"""
    + _GELU_MACROS
)

_SOURCES = {
    "gelu": ("T x", "T y", "typedef Acc<T>::type A; A a = (A)x; y = (T)(a * GELU_SIGMOID(a));"),
    "gelu_grad": (
        "T g, T x",
        "T y",
        "typedef Acc<T>::type A; A a = (A)x; A s = GELU_SIGMOID(a); y = (T)((A)g * GELU_SLOPE(a, s));",
    ),
    # gelu(x + b), b broadcast over x's rows (the MLP's first bias, added here: fused.gelu_array);
    # x + b rounded to T first, as an add of its own would store it
    "gelu_bias": (
        "T x, T b",
        "T y",
        "typedef Acc<T>::type A; A a = (A)(T)((A)x + (A)b); y = (T)(a * GELU_SIGMOID(a));",
    ),
    "gelu_and_grad": (  # h = gelu(x) and gh *= gelu'(x) from one sigmoid (the MLP's backward)
        "T x",
        "T h, T gh",
        "typedef Acc<T>::type A; A a = (A)x; A s = GELU_SIGMOID(a); h = (T)(a * s);"
        " gh = (T)((A)gh * GELU_SLOPE(a, s));",
    ),
    # a projection's bias and the residual stream added to its GEMM's output in one pass, rounded
    # after each add as the two separate adds round (the same bits as them)
    "bias_residual": ("T y, T b, T r", "T out", "out = (T)((T)(y + b) + r);"),
}


@functools.cache
def _kernel(cupy, name: str):
    in_params, out_params, operation = _SOURCES[name]
    return cupy.ElementwiseKernel(in_params, out_params, operation, f"mpifsdp_{name}", preamble=_PREAMBLE)


def _run(name: str, *arrays):
    return _kernel(array_module_of(arrays[0]), name)(*arrays)


def gelu_into(out, x):
    _run("gelu", x, out)


def gelu_bias_into(out, x, b):
    """out = gelu(x + b), b broadcast over x's rows: the raw row kernel where x, b and out are
    contiguous and of one type (CuPy's elementwise kernel indexes a broadcast b by a division an
    element: bench/HISTORY.md), else the elementwise kernel."""
    if not _gelu_bias_rows_into(out, x, b):
        _run("gelu_bias", x, b, out)


def _gelu_bias_rows_into(out, x, b) -> bool:
    dtype, C = x.dtype.type, x.shape[-1] if x.ndim else 0
    arrays = (x, b, out)
    if dtype not in ELEMENT_TYPES or b.shape != (C,) or out.shape != x.shape or not x.size:
        return False
    if not all(a.dtype == x.dtype and a.flags.c_contiguous for a in arrays):
        return False
    kernel = _gelu_family_kernel(x, "gelu_bias_rows", _gelu_bias_rows_probe)
    if kernel is None:
        return False
    _gelu_bias_rows_launch(kernel, out, x, b)
    return True


def _gelu_family_kernel(x, name: str, probe):
    """The GELU family's kernel `name` for x's dtype, checked once against its twin (probe(xp, dtype,
    kernel)), or None where NVRTC cannot build it."""
    xp = array_module_of(x)
    kernels = GELU_SUMS.compiled(xp, x.dtype.type)
    if kernels is None:
        return None
    kernel = kernels[GELU_SUMS_KERNELS.index(name)]
    checked_once((name, x.dtype.type), lambda: probe(xp, x.dtype, kernel))
    return kernel


def _gelu_bias_rows_launch(kernel, out, x, b):
    C = x.shape[-1]
    n = x.size // C
    width = pack_width(x.dtype)
    packed = in_packs(x.dtype, (C,), x, b, out)
    tile = GELU_PACKS * width * GELU_ROWS_THREADS if packed else GELU_COLUMNS * GELU_ROWS_THREADS
    grid = (-(-C // tile), min(n, GELU_ROWS_MAX_Y))
    kernel(grid, (GELU_ROWS_THREADS,), (x, b, out, np.int32(n), np.int32(C), np.int32(packed)))


def _gelu_bias_rows_probe(xp, dtype, kernel):
    """The row kernel on 37 rows of 1101 (one element at a time: two column tiles, the second
    short) and on 5 rows of 4360 (in packs: several tiles, the last short) against its twin."""
    rng = np.random.default_rng(23)
    results = []
    for n, C in ((37, 1101), (5, 4360)):
        host_x, host_b = rng.normal(0, 2, (n, C)).astype(dtype), rng.normal(0, 1, C).astype(dtype)
        want = np.empty((n, C))
        _gelu_bias_rows_twin(None, None, (host_x, host_b, want, n, C, 0))
        x, b = xp.asarray(host_x), xp.asarray(host_b)
        y = xp.empty_like(x)
        _gelu_bias_rows_launch(kernel, y, x, b)
        bound = error_bound(dtype, 16, float(np.max(np.abs(want))))
        results.append((f"gelu(x + bias) on rows of {C}", to_numpy(y), want, bound))
    return results


def gelu_grad_into(out, g, x):
    _run("gelu_grad", g, x, out)


def gelu_and_grad_into(h, gh, x):
    _run("gelu_and_grad", x, h, gh)


def add_bias_residual_(y, b, r):
    """y = (y + b) + r in place, b broadcast over y's rows."""
    _run("bias_residual", y, b, r, y)


# -- the MLP's backward GELU with the column sums of its gradient: one launch ---------------------
# h = gelu(x (+ bias)) and gh *= gelu'(x (+ bias)), as gelu_and_grad, and the column sums of gh as
# written: the gradient of that bias, or of the bias of the linear that made x (tape.SumsWritten),
# with no reduction launch of its own, written in the arithmetic's type (the gradient buffer's on a
# GPU: float32 for 16-bit). A thread block takes a run of rows; each thread a pack of columns at a
# time (16 bytes where the rows allow), ROWS_AHEAD rows' loads in flight before it computes, its
# columns' partial sums in registers (one per element a row, in shared memory, and scalar loads, was
# ~7 times its traffic's time); the blocks' partials are added in the same launch, in two levels
# (base/kernels.py column_sums_done).
# blocks: 3 an SM (its __launch_bounds__), one wave, the fastest of the counts timed (gpu_check.py
# columns; bench/HISTORY.md); 512 where the device's count is not known
GELU_SUMS_THREADS, GELU_SUMS_AN_SM, GELU_SUMS_BLOCKS = 256, 3, 512
GELU_SUMS_SOURCE = cuda_source(__package__, "gelu_sums.cu")
GELU_COLUMNS, GELU_PACKS, GELU_ROWS_THREADS, GELU_ROWS_MAX_Y = 4, 2, 256, 65535  # gelu_bias_rows' launch
GELU_SUMS_KERNELS = ("gelu_and_grad_sums", "gelu_bias_rows")


class GeluSums(enum.IntFlag):
    """gelu_and_grad_sums' flags (GELU_* in gelu_sums.cu)."""

    BIAS = 1  # the bias (C) added to x first, rounded to ELEM as cuda/fused.py gelu_array's


_GELU_SUMS_BODY = (
    flag_defines(GeluSums, "GELU_")
    + f"typedef ACC A;\n#define GELU_COLUMNS {GELU_COLUMNS}\n#define GELU_PACKS {GELU_PACKS}\n"
    f"#define GELU_SUMS_THREADS {GELU_SUMS_THREADS}\n#define GELU_SUMS_AN_SM {GELU_SUMS_AN_SM}\n"
    + _GELU_MACROS
    + GELU_SUMS_SOURCE
)


def gelu_sums_source(dtype) -> str:
    return typed_source(dtype, _GELU_SUMS_BODY)


def _gelu_sums_twin(grid, block, args, shared_mem=0):
    x, bias, h, gh, partial, sums, done, n, C, per, flags = args
    n, C, per = int(n), int(C), int(per)
    x = x.reshape(n, C)
    a = (x + bias.reshape(C)).astype(x.dtype) if int(flags) & GeluSums.BIAS else x  # rounded as stored
    a = a.astype(np.float64)
    s = 1 / (1 + np.exp(np.clip(-2 * _C * (a + _K * a**3), -700, 700)))
    h.reshape(n, C)[...] = a * s
    g2 = gh.reshape(n, C)
    g2[...] = g2.astype(np.float64) * (s * (1 + a * (2 * _C + 6 * _C * _K * a * a) * (1 - s)))
    written = g2.astype(np.float64)  # the sums add gh as written (rounded to its type)
    parts = partial.reshape(-1, C)
    for k in range(parts.shape[0]):
        parts[k] = written[k * per : (k + 1) * per].sum(axis=0)
    sums[...] = parts.astype(np.float64).sum(axis=0)


def _gelu_bias_rows_twin(grid, block, args, shared_mem=0):
    x, bias, y, n, C, _packed = args
    n, C = int(n), int(C)
    a = (x.reshape(n, C) + bias.reshape(C)).astype(x.dtype).astype(np.float64)  # rounded, as stored
    y.reshape(n, C)[...] = a / (1 + np.exp(np.clip(-2 * _C * (a + _K * a**3), -700, 700)))


GELU_SUMS = family(
    "fused GELU with column sums",
    gelu_sums_source,
    GELU_SUMS_KERNELS,
    dict(gelu_and_grad_sums=_gelu_sums_twin, gelu_bias_rows=_gelu_bias_rows_twin),
)


def gelu_and_grad_sums_into(h2, gh2, x2, sums, bias=None) -> bool:
    """h2 = gelu(x2 (+ bias)), gh2 *= gelu'(x2 (+ bias)) over rows of (n, C) contiguous arrays (bias:
    (C,)), and sums (C,; in the arithmetic's type) = the column sums of gh2 as written, in one
    launch; False (nothing written) where it cannot run (then gelu_and_grad_into and a column sum
    do it)."""
    dtype = x2.dtype.type
    arrays = (x2, h2, gh2) + (() if bias is None else (bias,))
    usable = dtype in ELEMENT_TYPES and all(a.dtype == x2.dtype and a.flags.c_contiguous for a in arrays)
    n, C = x2.shape
    usable = usable and sums.dtype == accumulator(dtype) and sums.flags.c_contiguous and sums.shape == (C,)
    if not usable:
        return False
    kernel = _gelu_family_kernel(x2, "gelu_and_grad_sums", _gelu_sums_probe)
    if kernel is None:
        return False
    xp = array_module_of(x2)
    sms = multiprocessors(xp)
    _gelu_sums_launch(kernel, xp, h2, gh2, x2, sums, bias, GELU_SUMS_AN_SM * sms if sms else GELU_SUMS_BLOCKS)
    return True


def _gelu_sums_launch(kernel, xp, h2, gh2, x2, sums, bias, max_blocks: int):
    n, C = x2.shape
    blocks, per = row_runs(n, max_blocks)
    acc = accumulator(x2.dtype.type)
    partial = xp.empty((blocks, C), dtype=acc)
    done = column_sum_counters(xp, x2, "gelu_and_grad_sums", blocks)
    sizes = (np.int32(n), np.int32(C), np.int32(per), np.int32(GeluSums.BIAS if bias is not None else 0))
    args = (x2, x2 if bias is None else bias, h2, gh2, partial, sums, done, *sizes)  # x2: not read
    kernel((blocks,), (GELU_SUMS_THREADS,), args)


def _gelu_sums_probe(xp, dtype, kernel):
    """The kernel on 37 rows of 80 (in packs of 16 bytes) and of 83 (one element at a time) in 8
    blocks of 5 rows (the last of 2) and in 37 blocks (both levels of its column sums), without a
    bias and with one, against its twin on host copies of the same inputs; the sums within n times
    an element's bound."""
    rng = np.random.default_rng(11)
    n, results = 37, []
    for C in (80, 83):
        host_x, host_g = (rng.normal(0, 2, (n, C)).astype(dtype) for _ in range(2))
        host_bias = rng.normal(0, 1, C).astype(dtype)
        for bias in (None, host_bias):
            want_h, want_g, want_sums = np.empty((n, C)), host_g.astype(np.float64), np.empty(C)
            flags = GeluSums.BIAS if bias is not None else 0
            twin_args = (host_x, host_bias, want_h, want_g, np.empty((1, C)), want_sums, None, n, C, n, flags)
            _gelu_sums_twin(None, None, twin_args)
            bound = {
                k: error_bound(dtype, 16, float(np.max(np.abs(v))))
                for k, v in (("h", want_h), ("gh", want_g))
            }
            bound["sums"] = n * bound["gh"]
            for blocks in (8, n):  # 37 blocks of 1 row: two groups of column_sums_done
                x, gh = xp.asarray(host_x), xp.array(host_g)  # gh: written in place, a copy
                h, sums = xp.empty_like(x), xp.empty(C, dtype=accumulator(dtype))
                on_device = None if bias is None else xp.asarray(bias)
                _gelu_sums_launch(kernel, xp, h, gh, x, sums, on_device, max_blocks=blocks)
                got, want = {"h": h, "gh": gh, "sums": sums}, {"h": want_h, "gh": want_g, "sums": want_sums}
                what = f" of rows of {C}" + (" with a bias" if flags else "") + f" in {blocks} blocks"
                results += [(k + what, to_numpy(got[k]), want[k], bound[k]) for k in want]
    return results


# -- causal softmax over rows of (heads, T, T) scores: one thread block per row --------------------
# The scores of one row are read once into registers (T <= 1024 = 256 threads x 4), so the forward
# is one read and one write per element (the NumPy path: seven passes), and the backward
# d = p (d - rowsum(d p)) scale is two reads and one write.
_ROW_THREADS, _ROW_ITEMS = 256, 4
ROW_SOURCE = cuda_source(__package__, "causal_softmax.cu")
ROW_KERNELS = ("causal_softmax", "softmax_backward")
_ROW_BODY = f"#define ITEMS {_ROW_ITEMS}\n" + ROW_SOURCE


def row_source(dtype) -> str:
    return typed_source(dtype, _ROW_BODY)


def _causal_softmax_twin(grid, block, args, shared_mem=0):
    s, T, scale = args
    rows = s.reshape(-1, T, T)
    masked = rows.astype(np.float64) * float(scale) + np.triu(np.full((T, T), -np.inf), 1)
    e = np.exp(masked - masked.max(-1, keepdims=True))
    rows[...] = e / e.sum(-1, keepdims=True)


def _softmax_backward_twin(grid, block, args, shared_mem=0):
    d, p, T, scale = args
    d3, p3 = d.reshape(-1, T, T), p.reshape(-1, T, T).astype(np.float64)
    d64 = d3.astype(np.float64)
    d3[...] = p3 * (d64 - (d64 * p3).sum(-1, keepdims=True)) * float(scale)


ROWS = family(
    "fused causal softmax",
    row_source,
    ROW_KERNELS,
    dict(causal_softmax=_causal_softmax_twin, softmax_backward=_softmax_backward_twin),
)


def _row_launch(which: int, rows, T: int, scale: float, *arrays) -> bool:
    """Run kernel `which` over `rows` rows of T; False when it cannot run (T too long, no kernel)."""
    dtype = arrays[0].dtype.type
    if dtype not in ELEMENT_TYPES or T > _ROW_THREADS * _ROW_ITEMS:
        return False
    xp = array_module_of(arrays[0])
    kernels = ROWS.compiled(xp, dtype)
    if kernels is None:
        return False
    checked_once(("causal_softmax", dtype), lambda: _row_probe(xp, arrays[0].dtype, kernels))
    kernels[which]((rows,), (_ROW_THREADS,), (*arrays, np.int32(T), accumulator(dtype)(scale)))
    return True


def _row_probe(xp, dtype, kernels):
    """Both row kernels on 3 heads of T = 45 (rows longer than a warp, not a multiple of the items a
    thread takes) against their twins, the backward on the device's probabilities."""
    rng = np.random.default_rng(29)
    heads, T, scale = 3, 45, 0.3
    host_scores, host_d = (rng.normal(0, 2, (heads, T, T)).astype(dtype) for _ in range(2))
    args = (np.int32(T), accumulator(dtype)(scale))
    p, d = xp.array(host_scores), xp.array(host_d)
    kernels[0]((heads * T,), (_ROW_THREADS,), (p, *args))
    kernels[1]((heads * T,), (_ROW_THREADS,), (d, p, *args))
    want_p, want_d = host_scores.astype(np.float64), host_d.astype(np.float64)
    TWINS["causal_softmax"](None, None, (want_p, T, scale))
    TWINS["softmax_backward"](None, None, (want_d, to_numpy(p).astype(np.float64), T, scale))
    bound_d = error_bound(dtype, 2 * T, float(np.max(np.abs(host_d.astype(np.float64)))) * scale)
    return [
        ("the probabilities", to_numpy(p), want_p, error_bound(dtype, T, 1.0)),
        ("the scores' gradient", to_numpy(d), want_d, bound_d),
    ]


def causal_softmax_(scores3, scale: float) -> bool:
    """scores3 (heads, T, T) contiguous, in place: softmax(scores * scale + causal mask) per row."""
    return _row_launch(0, scores3.shape[0] * scores3.shape[1], scores3.shape[2], scale, scores3)


def softmax_backward_(d3, p3, scale: float) -> bool:
    """d3 in place: p (d - rowsum(d p)) scale, the gradient of the scores from that of p."""
    return _row_launch(1, d3.shape[0] * d3.shape[1], d3.shape[2], scale, d3, p3)
