"""Float tolerances measured from the run itself, not tuned to one machine (docs/design.md, "Parity").

Sharding changes only the order of floating-point operations: each rank sums over its part of the
batch, and the reduce-scatter sums the ranks' partial results. It perturbs rounding and nothing else.
How much a reordering of sums moves the result depends on the training trajectory (AdamW's division
by sqrt(v) where a gradient is near zero magnifies last bits), on the dtype, and on the machine's BLAS
kernels, so a fixed bound is tuned to one machine. Instead each test measures it: the same
single-process training in the same dtype, rerun with the global batch's rows in three other orders
(reversed, rolled, shuffled: the same samples, every batch sum in another order), gives `probe`, the
largest distance of such a rerun from the original; for float32 the float64 run is a fourth probe
(the error float32 already has). The sharded run must stay within

    RATIO * probe + FLOOR_ULPS * eps(dtype)        (relative L2 error against the original run)

RATIO = 8: the sharded run reorders in places the probes do not (per-rank partial sums in every batch
reduction, then the sum over ranks), and a ratio of two error norms made of a few amplified roundings
has a tail. Measured with bench/parity_kernels.py over N = 1..4 and the OpenBLAS kernels this CPU
runs, the worst sharded error was 3.0x its probe (so 0.37 of the bound); with the reversed order as
the only probe it reached 8.3x under the Prescott kernel, which is why the probe takes the largest of
several orders. A real bug (a missing 1/N, a wrong slice, a stale gradient) is off by O(1), 10^5
times the probe or more, so the margin costs no sensitivity. FLOOR_ULPS covers quantities every
probe happens to get exactly (probe = 0): 16 ulps of the dtype.
"""

from __future__ import annotations

import numpy as np

RATIO = 8.0
FLOOR_ULPS = 16


def rel_err(got, want) -> float:
    """Relative L2 distance of two equally ordered lists of arrays (the absolute one when want is 0)."""
    diff = np.sqrt(sum(float(np.sum((np.asarray(g, np.float64) - w) ** 2)) for g, w in zip(got, want)))
    scale = np.sqrt(sum(float(np.sum(np.asarray(w, np.float64) ** 2)) for w in want))
    return diff / scale if scale else diff


def bound(probe: float, dtype) -> float:
    """The largest relative error a reordered run in `dtype` may have, given the probe's."""
    return RATIO * probe + FLOOR_ULPS * float(np.finfo(dtype).eps)


def within(errors: dict, probes: dict, dtype) -> tuple[float, str]:
    """(worst ratio of error to bound, a report): errors and probes map a quantity to its rel. error."""
    ratios = {k: errors[k] / bound(probes[k], dtype) for k in errors}
    report = ", ".join(
        f"{k} {errors[k]:.2e} (probe {probes[k]:.2e}, bound {bound(probes[k], dtype):.2e})" for k in errors
    )
    return max(ratios.values()), report
