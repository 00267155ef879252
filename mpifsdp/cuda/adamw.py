"""AdamW's update of a flat group as one raw GPU kernel (decay, gradient scale and moments at once),
and of every group in one launch (adamw_groups: a device table of the groups, their hyperparameters
copied each step).

On the CPU, optimizers.adamw_update runs the update slice by slice; on a GPU each pass would be a
launch and a trip through memory. This kernel reads g, p, m, v once and writes them once: the
decoupled decay inside the group's decay segments (a small table on the device, each element tests
it), the LossScaler's unscale and the clip folded into one gradient scale (written back, so the
gradient after the step is the one the update used, as on the CPU), then the bias-corrected moments.
Float32 masters whose arrays are 16-byte aligned (CuPy's allocations are) move four elements a
thread at a time, as 16-byte loads and stores: one element at a time reached about half the
memory bandwidth (bench/HISTORY.md).
Arithmetic in float32 for float16 and float32 masters (double for float64). Its NumPy twin takes
the same arguments (base/kernels.py TWINS); it checks itself against it once before first use.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..base import kernels
from ..base.backend import array_module_of, to_numpy
from ..optim.device import implement

THREADS, MAX_BLOCKS = 256, 4096

SOURCE = kernels.cuda_source(__package__, "adamw.cu")
KERNELS = ("adamw_step", "adamw_groups")
PIECE = THREADS * 16  # elements a block of adamw_groups updates
_BODY = f"#define PIECE {PIECE}\n" + SOURCE


def source(dtype, cast=None) -> str:
    """The kernels for `dtype` masters; cast: the dtype adamw_groups casts the updated values to
    where asked (the next gather's param_dtype; default `dtype`, for kernels given no cast)."""
    cast_type = kernels.ELEMENT_TYPES[np.dtype(cast if cast is not None else dtype).type][0]
    return kernels.typed_source(dtype, f"#define CAST {cast_type}\n" + _BODY)


def _twin(grid, block, args, shared_mem=0):
    p, g, m, v, starts, stops, segments, n, decay, scale, b1, omb1, b2, omb2, lrb, bias2, eps = args
    g64 = g.astype(np.float64) * float(scale)
    g[...] = g64
    g64 = g.astype(np.float64)  # the scaled gradient as stored, as the kernel reads it back
    p64 = p.astype(np.float64)
    for start, stop in list(zip(starts, stops))[: int(segments)]:
        p64[int(start) : int(stop)] *= float(decay)
    m64 = m.astype(np.float64) * float(b1) + g64 * float(omb1)
    v64 = v.astype(np.float64) * float(b2) + g64 * g64 * float(omb2)
    p[...] = p64 - m64 / (np.sqrt(v64) / float(bias2) + float(eps)) * float(lrb)
    m[...], v[...] = m64, v64


def _groups_twin(grid, block, args, shared_mem=0):
    """adamw_step's twin on each group the table names (host memory on a CPU), and the casts."""
    table, groups, segments, hyper, tokens, skip = args
    if int(np.asarray(skip).reshape(-1)[0]):
        return
    t, k = np.asarray(table, dtype=np.int64), int(groups)
    dtype, cast_dtype = kernels.table_dtype(t[-1]), kernels.table_dtype(t[-2])
    casts, flags = t[7 * k + 2 : 8 * k + 2], t[8 * k + 2 : 9 * k + 2]
    n, first_segment = t[4 * k : 5 * k], t[6 * k + 1 : 7 * k + 2]
    pairs = np.asarray(segments, dtype=np.int64).reshape(-1, 2)
    for j in range(k):
        p, g, m, v = (kernels.host_array(int(t[a * k + j]), dtype, int(n[j])) for a in range(4))
        mine = pairs[int(first_segment[j]) : int(first_segment[j + 1])]
        h = np.asarray(hyper, dtype=np.float64)[9 * j : 9 * j + 9]
        _twin(None, None, (p, g, m, v, mine[:, 0], mine[:, 1], len(mine), int(n[j]), *h))
        if casts[j]:  # the cast as cast_flag_nonfinite's twin makes it, flagged the same way
            cast, flag = (
                kernels.host_array(int(casts[j]), cast_dtype, int(n[j])),
                kernels.host_array(int(flags[j]), np.int32, 1),
            )
            kernels.TWINS["cast_flag_nonfinite"](None, None, (p, cast, flag, int(n[j]), int(tokens[j])))


FAMILY = kernels.family(
    "the fused AdamW step", source, KERNELS, dict(adamw_step=_twin, adamw_groups=_groups_twin)
)
# float32 masters cast to each type by adamw_groups as it updates them (fully_shard's param_dtype)
kernels.family("the fused AdamW step, casting", lambda cast: source(np.float32, cast), KERNELS, {})


@functools.lru_cache(maxsize=1024)
def _segment_arrays(xp, segments: tuple):
    """A group's decay segments on the device (its starts, its stops), copied there once."""
    table = np.array(segments or ((0, 0),), dtype=np.int64).reshape(-1, 2)
    return xp.asarray(table[:, 0].copy()), xp.asarray(table[:, 1].copy())


def _launch(kernel, xp, p, g, m, v, hyper: tuple, decay_segments: tuple):
    starts, stops = _segment_arrays(xp, decay_segments)
    acc = kernels.accumulator(p.dtype.type)
    blocks = max(1, min(MAX_BLOCKS, -(-p.size // THREADS)))
    head = (p, g, m, v, starts, stops, np.int32(len(decay_segments)), np.int64(p.size))
    kernel((blocks,), (THREADS,), (*head, *(acc(h) for h in hyper)))


def step(p, g, m, v, *, decay, grad_scale, beta1, beta2, lr_over_bias1, bias2, eps, decay_segments) -> bool:
    """p, m, v (and g, scaled by grad_scale) updated in place; False where the kernel cannot run (a
    dtype without a kernel, arrays of different dtypes or not contiguous, no NVRTC)."""
    arrays = (p, g, m, v)
    dtype = p.dtype.type
    if dtype not in kernels.ELEMENT_TYPES or not all(
        a.dtype == p.dtype and a.flags.c_contiguous for a in arrays
    ):
        return False
    xp = array_module_of(p)
    compiled = FAMILY.compiled(xp, dtype)
    if compiled is None:
        return False
    kernels.checked_once(("adamw_step", dtype), lambda: _probe(xp, dtype, compiled[0]))
    hyper = (decay, grad_scale, beta1, 1.0 - beta1, beta2, 1.0 - beta2, lr_over_bias1, bias2, eps)
    _launch(compiled[0], xp, p, g, m, v, hyper, tuple(decay_segments))
    return True


def step_groups(updates: list) -> bool:
    """Each update (p, g, m, v, hyper, decay_segments, cast), `hyper` as step() takes its keywords
    (decay, grad_scale, beta1, beta2, lr_over_bias1, bias2, eps), done as step() would, in one
    launch for all of them and one copy of their hyperparameters; `cast`: None, or (buffer, flag,
    token) where the updated p is also cast to the buffer's dtype (one dtype for all) and flag set to
    token if that overflows. False (nothing done) where the kernel cannot run them all (another
    dtype, arrays not contiguous, no NVRTC)."""
    arrays = [a for u in updates for a in u[:4]]
    dtype = arrays[0].dtype.type if arrays else None
    xp = array_module_of(arrays[0]) if arrays else np
    casts = [u[6] for u in updates if u[6] is not None]
    cast = casts[0][0].dtype if casts else np.dtype(dtype)
    fits = all(c[0].dtype == cast and c[0].flags.c_contiguous for c in casts)
    if (
        dtype not in kernels.ELEMENT_TYPES
        or not fits
        or not all(a.dtype == arrays[0].dtype and a.flags.c_contiguous and a.size for a in arrays)
    ):
        return False
    compiled = FAMILY.compiled(xp, dtype, source(dtype, cast))
    if compiled is None:
        return False
    key = ("adamw_groups" + (f" casting to {cast.name}" if casts else ""), dtype)
    kernels.checked_once(key, lambda: _probe_groups(xp, dtype, compiled[1], cast if casts else None))
    _launch_groups(compiled[1], xp, updates)
    return True


def hyper_row(h: dict) -> tuple:
    """adamw_groups' row of one group's step from hyperparameters()'s keywords."""
    b1, b2 = h["beta1"], h["beta2"]
    return (h["decay"], h["grad_scale"], b1, 1.0 - b1, b2, 1.0 - b2, h["lr_over_bias1"], h["bias2"], h["eps"])


_group_tables: dict = {}  # (addresses, lengths, segments) of the groups -> (table, segments, blocks)


def _addresses(u) -> tuple:
    """An update's p, g, m, v addresses, then its cast's and flag's (0: none)."""
    cast = u[6] or (None, None)
    return tuple(kernels.device_address(a) for a in u[:4]) + tuple(
        0 if a is None else kernels.device_address(a) for a in cast[:2]
    )


def _table_dtypes(updates: list) -> tuple:
    """(the casts' dtype, the groups') by name, which the table records for the twin (the casts':
    the groups' own where none casts)."""
    own = updates[0][0].dtype.name
    return next((u[6][0].dtype.name for u in updates if u[6] is not None), own), own


def _groups_table(xp, updates: list):
    """The device table adamw_groups reads (cached: the shards, moments and casts stay where they
    are)."""
    groups = tuple((_addresses(u), u[0].size, tuple(u[5])) for u in updates)
    key = (groups, _table_dtypes(updates))
    if key not in _group_tables:
        host, pairs, blocks = groups_table_host(updates)
        if len(_group_tables) > 64:  # buffers moved: forget old layouts
            _group_tables.clear()
        _group_tables[key] = (xp.asarray(host), xp.asarray(pairs), blocks)
    return _group_tables[key]


def groups_table_host(updates: list) -> tuple:
    """(the table, the decay segments' pairs, the blocks) of adamw_groups for `updates`, on the host
    (int64): the addresses, lengths and pieces the kernel reads."""
    sizes = [u[0].size for u in updates]
    first = np.concatenate([[0], np.cumsum([-(-n // PIECE) for n in sizes])])
    first_segment = np.concatenate([[0], np.cumsum([len(u[5]) for u in updates])])
    addresses = [_addresses(u) for u in updates]
    columns = [[a[c] for a in addresses] for c in range(6)]
    dtypes = [kernels.TABLE_DTYPES.index(name) for name in _table_dtypes(updates)]
    host = np.concatenate([*columns[:4], sizes, first, first_segment, *columns[4:], dtypes])
    pairs = np.array([pair for u in updates for pair in u[5]] or [(0, 0)], dtype=np.int64).reshape(-1)
    return host.astype(np.int64), pairs, int(first[-1])


def _launch_groups(kernel, xp, updates: list, tables=None, hyper=None, skip=None):
    """adamw_groups on `updates`; tables: (table, segments, blocks) where not _groups_table's (a
    whole-step graph's, written after its capture); hyper and skip: device arrays of the kernel's
    own (the graph's verdict writes them), else this step's rows copied there and never skipped."""
    table, segments, blocks = tables or _groups_table(xp, updates)
    acc = kernels.accumulator(updates[0][0].dtype.type)
    if hyper is None:
        hyper = xp.asarray(np.array([hyper_row(u[4]) for u in updates], dtype=acc).reshape(-1))
    tokens = _tokens(xp, tuple(0 if u[6] is None else int(u[6][2]) for u in updates))
    skip = _tokens(xp, (0,)) if skip is None else skip
    kernel((blocks,), (THREADS,), (table, np.int32(len(updates)), segments, hyper, tokens, skip))


def _tokens(xp, tokens: tuple):
    """The groups' flag tokens on the device (0: the group casts nothing), copied there once: a
    unit's token is a constant (shard/cast.py OVERFLOWED), so the same few arrays serve every step."""
    if len(_token_arrays) > 64:
        _token_arrays.clear()
    key = (xp, tokens)
    if key not in _token_arrays:
        _token_arrays[key] = xp.asarray(np.array(tokens, dtype=np.int32))
    return _token_arrays[key]


_token_arrays: dict = {}


def _probe_groups(xp, dtype, kernel, cast=None):
    """Two groups (one of several pieces and decay segments, its length and theirs not multiples of
    4; one shorter than a piece, none, not 16-byte aligned) in one launch against adamw_step's twin
    on each, after a launch its skip flag skips (a second update would show); with `cast`, the first
    group's update cast to it too, one master far beyond float16's range (its flag set where the cast
    overflows)."""
    rng = np.random.default_rng(17)
    sizes, segments = (2 * PIECE + 103, 701), (((10, 701), (PIECE + 5, 2 * PIECE + 2)), ())
    hypers = [
        dict(decay=0.999, grad_scale=0.25, beta1=0.9, beta2=0.95, lr_over_bias1=1e-3, bias2=0.5, eps=1e-8),
        dict(decay=1.0, grad_scale=0.25, beta1=0.8, beta2=0.99, lr_over_bias1=2e-3, bias2=0.7, eps=1e-6),
    ]
    host = [
        [rng.normal(0, s, n).astype(dtype) for s in (1, 1, 0.1)] + [rng.uniform(0, 0.1, n).astype(dtype)]
        for n in sizes
    ]
    if cast is not None:
        host[0][0][PIECE + 7] = 1e6
    want = [[a.astype(np.float64) for a in arrays] for arrays in host]
    device = [[xp.array(a) for a in host[0]], [_one_element_in(xp, a) for a in host[1]]]
    casts = [None, None]
    if cast is not None:
        casts[0] = (xp.empty(sizes[0], dtype=cast), xp.zeros(1, dtype=np.int32), 5)
    batch = [(*d, h, seg, c) for d, h, seg, c in zip(device, hypers, segments, casts)]
    _launch_groups(kernel, xp, batch, skip=xp.ones(1, dtype=np.int32))  # skipped: nothing may change
    _launch_groups(kernel, xp, batch)
    for w, h, seg in zip(want, hypers, segments):
        pairs = np.array(seg or [(0, 0)], dtype=np.int64).reshape(-1, 2)
        _twin(None, None, (*w, pairs[:, 0], pairs[:, 1], len(seg), w[0].size, *hyper_row(h)))
    results = [
        (f"{k} of group {j}", to_numpy(d), x, kernels.error_bound(dtype, 16, float(np.max(np.abs(x)))))
        for j, (dev, wan) in enumerate(zip(device, want))
        for k, d, x in zip(("p", "g", "m", "v"), dev, wan)
    ]
    if cast is not None:  # the twin's float64 p cast: within an element's rounding of the device's
        want_cast, want_flag = np.empty(sizes[0], dtype=cast), np.zeros(1, dtype=np.int32)
        kernels.TWINS["cast_flag_nonfinite"](None, None, (want[0][0], want_cast, want_flag, sizes[0], 5))
        bound = kernels.error_bound(cast, 16, float(np.max(np.abs(want[0][0]))))
        results += [
            ("the cast", kernels.comparable(to_numpy(casts[0][0])), kernels.comparable(want_cast), bound),
            ("its flag", to_numpy(casts[0][1]), want_flag, 0.0),
        ]
    return results


def _one_element_in(xp, a):
    """A device copy of `a` that starts one element into its allocation: not 16-byte aligned, so
    adamw_groups updates it one element at a time, not four."""
    buffer = xp.empty(a.size + 1, dtype=a.dtype)
    buffer[1:] = xp.asarray(a)
    return buffer[1:]


def _probe(xp, dtype, kernel):
    """One step of 3000 elements, two decay segments and a gradient scale, against the twin."""
    rng = np.random.default_rng(13)
    n = 3000
    host = [rng.normal(0, 1, n), rng.normal(0, 1, n), rng.normal(0, 0.1, n), rng.uniform(0, 0.1, n)]
    host = [a.astype(dtype) for a in host]
    want = [a.astype(np.float64) for a in host]  # copied before the kernel updates its own inputs
    device = [xp.array(a) for a in host]
    hyper, segments = (0.999, 0.25, 0.9, 0.1, 0.95, 0.05, 1e-3, 0.5, 1e-8), ((10, 700), (2000, 2900))
    _launch(kernel, xp, *device, hyper, segments)
    _twin(None, None, (*want, np.array([10, 2000]), np.array([700, 2900]), 2, n, *hyper))
    names = ("p", "g", "m", "v")
    return [
        (k, to_numpy(d), w, kernels.error_bound(dtype, 16, float(np.max(np.abs(w)))))
        for k, d, w in zip(names, device, want)
    ]


# -- the optimizer's step on a GPU (optim/device.py) -----------------------------------------------


def hyperparameters(lr, beta1, beta2, eps, step, weight_decay, grad_scale) -> dict:
    """What the kernels take for one step: the decay factor and the bias corrections folded."""
    bias1, bias2 = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
    folded = dict(decay=1.0 - lr * weight_decay, lr_over_bias1=lr / bias1, bias2=bias2)
    return dict(grad_scale=grad_scale, beta1=beta1, beta2=beta2, eps=eps, **folded)


@implement("adamw_update", "cuda")
def update_one(p, g, m, v, *, decay_segments, **keywords) -> bool:
    """optimizers.adamw_update on one flat group, in one launch (step)."""
    return step(p, g, m, v, decay_segments=decay_segments, **hyperparameters(**keywords))


@implement("adamw_step_all", "cuda")
def update_all(optimizer, updates: list) -> bool:
    """Every group of an AdamW step in one launch (step_groups), each updated shard's next gather's
    param_dtype cast written too where its Unit keeps one (cast_target)."""
    casts = _cast_targets([optimizer.groups[i] for i, *_ in updates])
    batch = [
        (p, g, state["exp_avg"], state["exp_avg_sq"], hyperparameters(**optimizer.hyperparameters_at(step)))
        + (optimizer.decayed(i), cast)
        for (i, p, g, state, step), cast in zip(updates, casts)
    ]
    if not step_groups(batch):
        return False
    for (i, *_), cast in zip(updates, casts):
        if cast is not None:
            optimizer.groups[i].cast_written()
    return True


def _cast_targets(groups) -> list:
    """Per group, where the update kernel writes its next gather's param_dtype cast (a Unit's
    cast_target), or None; all None unless they share one dtype (one kernel type)."""
    casts = [getattr(group, "cast_target", lambda: None)() for group in groups]
    dtypes = {cast[0].dtype for cast in casts if cast is not None}
    return casts if len(dtypes) <= 1 else [None] * len(casts)
