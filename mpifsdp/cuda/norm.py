"""The sum of squares of every group's gradient, for the step's norm, in two GPU launches.

A dot product a group is a launch a group (25 a step for the 24-layer GPT), each a small reduction
over a sharded gradient. Here one kernel takes them all through a table of addresses and lengths on
the device: every thread block sums the squares of one piece of one vector into a partial, and a
second kernel adds each vector's partials in order. Float32 arithmetic for float16 and float32
gradients (double for float64), no atomics: the same sums on every run. Its NumPy twins take the
same arguments (base/kernels.py TWINS); it checks itself once against float64 before first use.
"""

from __future__ import annotations

import numpy as np

from ..base import kernels
from ..base.backend import array_module_of, to_numpy
from ..optim.device import implement

THREADS, PIECE = 256, 256 * 16  # elements a block sums

SOURCE = kernels.cuda_source(__package__, "norm.cu")
KERNELS = ("squares_by_piece", "sum_pieces")
_BODY = f"#define PIECE {PIECE}\n" + SOURCE


def source(dtype) -> str:
    return kernels.typed_source(dtype, _BODY)


def _table_parts(table, vectors: int):
    """(addresses, lengths, first pieces, element dtype) of a table."""
    t = np.asarray(table, dtype=np.int64)
    return (
        t[:vectors],
        t[vectors : 2 * vectors],
        t[2 * vectors : 3 * vectors + 1],
        kernels.table_dtype(t[-1]),
    )


def _squares_twin(grid, block, args, shared_mem=0):
    """Reads the vectors where the table's addresses say (host memory on a CPU)."""
    table, vectors, partial = args
    addresses, lengths, first, dtype = _table_parts(table, int(vectors))
    for v in range(int(vectors)):
        x = kernels.host_array(int(addresses[v]), dtype, int(lengths[v])).astype(np.float64)
        for b in range(int(first[v]), int(first[v + 1])):
            piece = x[(b - int(first[v])) * PIECE : (b - int(first[v]) + 1) * PIECE]
            partial[b] = piece @ piece


def _sum_pieces_twin(grid, block, args, shared_mem=0):
    partial, table, vectors, sums = args
    first = _table_parts(table, int(vectors))[2]
    for v in range(int(vectors)):
        sums[v] = np.asarray(partial[int(first[v]) : int(first[v + 1])], dtype=np.float64).sum()


FAMILY = kernels.family(
    "the gradient norm's sums of squares",
    source,
    KERNELS,
    dict(squares_by_piece=_squares_twin, sum_pieces=_sum_pieces_twin),
)

_tables: dict = {}  # (address, length, dtype) of each vector -> the table on the device


def _table(xp, vectors: list):
    key = tuple((kernels.device_address(v), v.size, v.dtype.str) for v in vectors)
    if key not in _tables:
        host, pieces = table_host(vectors)
        if len(_tables) > 64:  # buffers moved (a pool reshuffled): forget old layouts
            _tables.clear()
        _tables[key] = (xp.asarray(host), pieces)
    return _tables[key]


def table_host(vectors: list) -> tuple:
    """(the table squares_by_piece reads, int64 on the host: addresses, lengths, first pieces, dtype;
    the pieces)."""
    pieces = np.array([-(-v.size // PIECE) for v in vectors], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(pieces)])
    columns = (
        [kernels.device_address(v) for v in vectors],
        [v.size for v in vectors],
        first,
        [kernels.TABLE_DTYPES.index(vectors[0].dtype.name)],
    )
    return np.concatenate(columns).astype(np.int64), int(first[-1])


def sums_of_squares(vectors: list):
    """sum(v * v) of each vector, as one device array in the arithmetic's dtype (float32; float64 for
    float64 vectors), in two launches; None where the kernels cannot run (not one dtype with a
    kernel, not contiguous, empty, no NVRTC): the caller then runs a dot a vector."""
    dtype = vectors[0].dtype.type if vectors else None
    if (
        not vectors
        or dtype not in kernels.ELEMENT_TYPES
        or not all(v.dtype == vectors[0].dtype and v.flags.c_contiguous and v.size for v in vectors)
    ):
        return None
    xp = array_module_of(vectors[0])
    compiled = FAMILY.compiled(xp, dtype)
    if compiled is None:
        return None
    kernels.checked_once(("sum_of_squares", dtype), lambda: _probe(xp, dtype, compiled))
    return _launch(compiled, xp, vectors)


def _launch(compiled, xp, vectors: list, table=None):
    """The sums of `vectors`; table: (table, pieces) where not _table's (a whole-step graph's,
    written after its capture)."""
    table, pieces = table or _table(xp, vectors)
    acc = kernels.accumulator(vectors[0].dtype.type)
    partial, sums = xp.empty(pieces, dtype=acc), xp.empty(len(vectors), dtype=acc)
    n = np.int32(len(vectors))
    compiled[0]((pieces,), (THREADS,), (table, n, partial))
    compiled[1]((len(vectors),), (THREADS,), (partial, table, n, sums))
    return sums


def _probe(xp, dtype, compiled):
    """Three vectors of unequal lengths (one of several pieces, one shorter than a piece) against float64."""
    rng = np.random.default_rng(11)
    host = [rng.normal(0, 1, n).astype(dtype) for n in (3 * PIECE + 17, 5, PIECE)]
    got = to_numpy(_launch(compiled, xp, [xp.asarray(h) for h in host]))
    want = np.array([h.astype(np.float64) @ h.astype(np.float64) for h in host])
    return [("sums", got, want, kernels.error_bound(dtype, 2 * PIECE, float(want.max())))]


@implement("sums_of_squares", "cuda")
def sums_for_the_norm(grads: list):
    """Each gradient's sum of squares as one device array (sums_of_squares, else a dot a group),
    read with the step's verdict (optim/verdict.py)."""
    sums = sums_of_squares(grads)  # two launches for every group
    return array_module_of(grads[0]).stack([g @ g for g in grads]) if sums is None else sums
