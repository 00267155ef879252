"""The step's verdict as kernels, and the whole step queued for a CUDA graph (optim/device_step.py).

Why: a graph that holds the optimizer's step must decide on the device what the host decides after
reading the norm (skip, clip, the loss scale, the step counts). Two one-thread kernels do it
(step.cu): verdict_sums adds the groups' sums of squares in the host's order and notes a failed
check; step_verdict, after the sums' all-reduce, moves the state on as LossScaler.step and
FlatOptimizer.step would and writes AdamW's rows and a skip flag, which adamw_groups reads. Their
NumPy twins take the same arguments (base/kernels.py TWINS); a probe checks the kernels against them
once before first use. The kernels' tables hold the gradients' addresses, which only the capture
decides: they are allocated before it and written after it (`queue` returns the writer).
"""

from __future__ import annotations

import math

import numpy as np

from ..base import backend, kernels
from ..base.backend import array_module_of, to_numpy
from ..optim.device import implement
from ..optim.device_step import PLACES, STOPS
from . import adamw, norm

KERNELS = ("verdict_sums", "step_verdict")
_DEFINES = "".join(f"#define S_{name.upper()} {i}\n" for i, name in enumerate(PLACES))
_DEFINES += "".join(f"#define STOP_{name.upper()} {i}\n" for i, name in enumerate(STOPS))
SOURCE = _DEFINES + kernels.cuda_source(__package__, "step.cu")
S = {name: i for i, name in enumerate(PLACES)}


def source(dtype) -> str:
    """The kernels for `dtype` masters (their ACC: the rows' type)."""
    return kernels.typed_source(dtype, SOURCE)


def _sums_twin(grid, block, args, shared_mem=0):
    """verdict_sums on the host: the sums added in order in float64, the check noted."""
    sums, groups, refused, reduced = args
    reduced[0] = sum(float(x) for x in np.asarray(sums)[: int(groups)])
    reduced[1] = 1.0 if bool(np.asarray(refused).reshape(-1)[0]) else 0.0


def _overflowed(state) -> bool:
    """step.cu's overflowed on the host."""
    if state[S["scaled"]] == 0.0:
        if state[S["raise"]] != 0.0:
            return True
        state[S["skipped"]] += 1
        return False
    if state[S["scale"]] <= state[S["min_scale"]] or state[S["skips_in_a_row"]] + 1 >= state[S["max_skips"]]:
        return True
    state[S["skipped"]] += 1
    state[S["skips_in_a_row"]] += 1
    state[S["good"]] = 0
    state[S["scale"]] = max(state[S["min_scale"]], state[S["scale"]] / 2)
    return False


def _verdict_twin(grid, block, args, shared_mem=0):
    """step_verdict on the host, decision by decision."""
    reduced, state, hyper, skip, groups = args
    skip[0] = 1
    if state[S["dry"]] != 0.0:
        return
    if reduced[1] != 0.0:
        state[S["stop"]] = STOPS.index("refused")
        return
    scaled = state[S["scaled"]] != 0.0
    value = math.sqrt(float(reduced[0])) if reduced[0] >= 0 else math.nan
    state[S["norm"]] = value = value / state[S["scale"]] if scaled else value
    if not math.isfinite(value):
        if _overflowed(state):
            state[S["stop"]] = STOPS.index("scale" if scaled else "nonfinite")
        return
    factor = 1.0
    if scaled:
        state[S["skips_in_a_row"]], factor = 0, 1.0 / state[S["scale"]]
    if state[S["max_norm"]] > 0.0:
        factor *= min(1.0, state[S["max_norm"]] / (value + 1e-6))
    state[S["factor"]] = factor
    state[S["taken"]] += 1
    _rows_twin(state, hyper, int(groups), factor)
    if scaled:
        state[S["good"]] += 1
        if math.fmod(state[S["good"]], state[S["growth"]]) == 0.0:
            state[S["scale"]] *= 2
    skip[0] = 0


def _rows_twin(state, hyper, groups: int, factor: float):
    """step.cu's hyper_rows: adamw_groups' rows as the host makes them for an eager step."""
    lr, b1, b2, eps, decay = (float(state[S[k]]) for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    for k in range(groups):
        step = float(state[S["groups"] + k] + state[S["taken"]])
        h = adamw.hyperparameters(lr, b1, b2, eps, step, decay, factor)
        hyper[9 * k : 9 * k + 9] = adamw.hyper_row(h)


FAMILY = kernels.family(
    "the step's verdict", source, KERNELS, dict(verdict_sums=_sums_twin, step_verdict=_verdict_twin)
)


class WholeStep:
    """The device's side of optim/device_step.py's DeviceStep: `ready` before a capture, `queue`
    inside it."""

    def ready(self, updates: list) -> tuple:
        """Before the capture (which can neither compile-and-check nor read back, nor copy host
        memory in): the kernels compiled and checked, the small arrays they take made, and their
        tables written for `updates` (p, g, m, v, decay segments), as `queue` takes them."""
        p = updates[0][0]
        xp, dtype = array_module_of(p), p.dtype.type
        self._compiled(xp, dtype)
        adamw._tokens(xp, (0,) * len(updates))
        adamw._tokens(xp, (0,))
        norm_host, pieces = norm.table_host([u[1] for u in updates])
        host, pairs, blocks = adamw.groups_table_host(_batch(updates))
        return (xp.asarray(norm_host), pieces), (xp.asarray(host), xp.asarray(pairs), blocks)

    def _compiled(self, xp, dtype):
        """(the verdict's kernels, the norm's, adamw_groups), compiled and checked once."""
        found = FAMILY.compiled(xp, dtype), norm.FAMILY.compiled(xp, dtype), adamw.FAMILY.compiled(xp, dtype)
        if any(f is None for f in found):
            raise kernels.SlowPathError(
                "a whole-step CUDA graph needs its kernels (the verdict's, the norm's, AdamW's): "
                "NVRTC cannot build them here"
            )
        kernels.checked_once(("step_verdict", dtype), lambda: _probe(xp, dtype, found[0]))
        kernels.checked_once(("sum_of_squares", dtype), lambda: norm._probe(xp, dtype, found[1]))
        kernels.checked_once(("adamw_groups", dtype), lambda: adamw._probe_groups(xp, dtype, found[2][1]))
        return found

    def queue(self, tables: tuple, state, updates: list, flags: list, checks: list, comms, scales: list):
        """The step after the passes (optim/device_step.py DeviceStep.queue), on `ready`'s tables:
        the sums summed over comms[0] (and comms[1], HSDP's replicas, where given: for the failed
        checks only). Returns (the per-group sums, the tables' writer to call after the capture)."""
        p = updates[0][0]
        xp, dtype, k = array_module_of(p), p.dtype.type, len(updates)
        verdict, sums_kernels, update = self._compiled(xp, dtype)
        grads, batch = [u[1] for u in updates], _batch(updates)
        sums = norm._launch(sums_kernels, xp, grads, table=tables[0])
        reduced = xp.empty(2, dtype=np.float64)
        verdict[0]((1,), (1,), (sums, np.int32(k), _refused(xp, flags, checks), reduced))
        for comm, part in zip(comms, (reduced, reduced[1:])):  # replicas: their failed checks only
            if comm is not None:
                comm.wait(comm.iall_reduce(part, unit="a graphed step's verdict", phase="optimizer"))
        hyper, skip = xp.empty(9 * k, dtype=kernels.accumulator(dtype)), xp.empty(1, dtype=np.int32)
        verdict[1]((1,), (1,), (reduced, state, hyper, skip, np.int32(k)))
        for scale in scales:  # the loss scale the next forward multiplies by
            scale[...] = state[S["scale"]]
        adamw._launch_groups(update[1], xp, batch, tables=tables[1], hyper=hyper, skip=skip)

        def fill():
            backend.write_into(tables[0][0], norm.table_host(grads)[0])
            backend.write_into(tables[1][0], adamw.groups_table_host(batch)[0])

        return sums, fill


def _batch(updates: list) -> list:
    """(p, g, m, v, decay segments) as adamw_groups' updates: no host row, no cast (a graph's
    gathers cast afresh)."""
    return [(*u[:4], None, tuple(u[4]), None) for u in updates]


def _refused(xp, flags: list, checks: list):
    """A device bool: a gather's cast overflowed (its flag holds its token) or an input check failed,
    one elementwise or at a time (a stack of many arrays copies a table of their addresses from the
    host, which a capture refuses)."""
    found = xp.zeros((), dtype=bool)
    for flag, token in (taken for _, taken in flags):
        xp.logical_or(found, flag.reshape(-1)[0] == token, out=found)
    for failed, *_ in checks:
        xp.logical_or(found, failed.reshape(()), out=found)
    return found


_STEP = WholeStep()


@implement("whole_step", "cuda")
def whole_step(*_) -> WholeStep:
    """The GPU's side of a whole-step graph."""
    return _STEP


def _probe(xp, dtype, compiled):
    """verdict_sums and step_verdict against their twins: a clipped scaled step that grows the scale,
    an overflow that halves it, one that stops at the scale's floor, a refused check, one without a
    scaler that steps and one that stops, the capture's dry check that moves nothing."""
    rng = np.random.default_rng(19)
    sums = rng.uniform(0, 4, 5).astype(kernels.accumulator(dtype))
    base = np.zeros(len(PLACES) - 1 + 5)
    base[[S[k] for k in ("scale", "lr", "max_norm", "growth", "min_scale", "max_skips", "scaled")]] = (
        1024.0,
        3e-4,
        0.01,
        2,
        1.0,
        4,
        1,
    )
    base[[S[k] for k in ("good", "beta1", "beta2", "eps", "weight_decay")]] = (1, 0.9, 0.95, 1e-8, 0.1)
    base[S["groups"] :] = (0, 3, 7, 0, 1)
    cases = [(base, sums, False), (base, sums * np.inf, False), (base, sums, True)]
    floor = base.copy()
    floor[S["scale"]] = 1.0
    unscaled = base.copy()
    unscaled[[S["scaled"], S["raise"]]] = 0, 1
    dry = base.copy()
    dry[S["dry"]] = 1
    cases += [(floor, sums * np.nan, False), (unscaled, sums, False), (unscaled, sums * np.inf, False)]
    cases += [(dry, sums, False)]
    results = []
    for c, (state, s, refused) in enumerate(cases):
        results += _probe_case(xp, dtype, compiled, c, state, s, refused)
    return results


def _probe_case(xp, dtype, compiled, c: int, state, sums, refused: bool) -> list:
    """One case's state, rows and skip from the kernels and from the twins."""
    groups, acc = len(state) - S["groups"], kernels.accumulator(dtype)
    outs = []
    for sum_kernel, verdict_kernel, module in ((*compiled, xp), (_sums_twin, _verdict_twin, np)):
        reduced, st = module.zeros(2), module.asarray(state.copy())
        hyper, skip = module.zeros(9 * groups, dtype=acc), module.zeros(1, dtype=np.int32)
        args = (module.asarray(sums), np.int32(groups), module.asarray(np.array([refused])), reduced)
        sum_kernel((1,), (1,), args)
        verdict_kernel((1,), (1,), (reduced, st, hyper, skip, np.int32(groups)))
        outs.append([to_numpy(a) for a in (st, hyper, skip)])
    (st, hyper, skip), (want_st, want_hyper, want_skip) = outs
    finite = np.isfinite(want_st)
    rows_bound = kernels.error_bound(dtype, 2, float(np.abs(want_hyper).max()))
    return [
        (f"case {c}'s state", np.where(finite, st, 0), np.where(finite, want_st, 0), 4e-16 * 2**11),
        (f"case {c}'s rows", hyper, want_hyper, rows_bound),
        (f"case {c}'s skip", skip, want_skip, 0.0),
    ]
