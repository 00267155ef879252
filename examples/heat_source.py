"""An inverse problem in plain NumPy, sharded with mpifsdp.Unit: find the heat source of a rod.

A rod of G cells, held at 0 at both ends, heated by an unknown source q. Its steady temperature is
T = A q with A the inverse of the discrete Laplacian; S = 997 sensors read T at random points (with
noise). Each rank holds 1/N of q and of the optimizer state, and its own rows of the sensors: 997
rows do not divide over 2, 3 or 4 ranks, so each rank weights its mean gradient by its row count
(`reduce_grad(weight=...)`, `rank_slice(even=False)`). Momentum SGD on the least-squares misfit
plus a smoothness penalty; gradients by hand.

    mpiexec -n 3 python -m mpi4py examples/heat_source.py --steps 150 --save out/heat
    mpiexec -n 2 python -m mpi4py examples/heat_source.py --steps 300 --save out/heat --resume

The same iterations run in plain NumPy on one process (every rank computes them: the problem is
small) and the sharded result must match them to 1e-12: resuming at another world size included.
`--lbfgs` shows the pattern for SciPy's full-batch optimizers on a Unit (see `lbfgs`).
`--deterministic` cuts the sensors into 12 fixed chunks and sums their gradients exactly
(`Unit.add_chunk_grad` / `reduce_chunk_grads`, docs/determinism.md): the source it prints a hash of
has the same bits on 1, 2, 3, 4, 6 or 12 ranks.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np

from mpifsdp import SGD, Comm, Unit, checkpoint, full_state_dict
from mpifsdp.data import rank_slice

G, SENSORS, NOISE, SMOOTH, LR, MOMENTUM = 120, 997, 1e-3, 1e-4, 0.4, 0.9
CHUNKS = 12  # --deterministic: the sensors in 12 fixed groups of rows (84 or 83 each)


def problem():
    """The forward operator (sensors x cells), the readings, and the true source."""
    rng = np.random.default_rng(0)
    laplacian = (np.diag(np.full(G, 2.0)) - np.diag(np.ones(G - 1), 1) - np.diag(np.ones(G - 1), -1)) * G**2
    x = (np.arange(G) + 0.5) / G
    truth = np.exp(-(((x - 0.3) / 0.15) ** 2)) + 0.5 * np.exp(-(((x - 0.7) / 0.2) ** 2))
    rows = rng.integers(0, G, SENSORS)
    operator = np.linalg.inv(laplacian)[rows] * G  # temperature at each sensor per unit of source
    readings = operator @ truth + NOISE * rng.standard_normal(SENSORS)
    return operator, readings, truth


def gradient(q, operator, readings):
    """Gradient of mean((operator q - readings)^2) / 2 over these rows, plus the smoothness penalty."""
    residual = operator @ q - readings
    penalty = np.zeros_like(q)
    d = np.diff(q)
    penalty[:-1] -= d
    penalty[1:] += d
    return operator.T @ residual / len(readings) + SMOOTH * G * penalty


def reference(steps, operator, readings):
    """The same momentum SGD in plain NumPy, on all rows in one process."""
    q, buf = np.zeros(G), None
    for _ in range(steps):
        g = gradient(q, operator, readings)
        buf = g.copy() if buf is None else MOMENTUM * buf + g
        q = q - LR * buf
    return q


def objective(q, operator, readings):
    """mean((operator q - readings)^2) / 2 over these rows, plus the smoothness penalty."""
    residual = operator @ q - readings
    return 0.5 * float(residual @ residual) / len(readings) + 0.5 * SMOOTH * G * float(
        np.diff(q) @ np.diff(q)
    )


def lbfgs(unit, comm, operator, readings):
    """Full-batch L-BFGS from SciPy on the gathered vector. Every rank runs the same iterations on the
    same full vector (identical inputs, deterministic algorithm: checked at every evaluation, bit for
    bit); only the data is split: each evaluation is a weighted reduce-scatter of the gradient (then
    gathered) and one scalar all-reduce of the objective. The result is written back into the shards."""
    from scipy.optimize import minimize

    rows = len(readings)
    total = comm.all_reduce_scalar(rows, what="the sensor rows")

    def value_and_gradient(q):
        # every rank must evaluate at the same point (the same iterations on the same values): a rank
        # whose inputs differ would otherwise write back a mixture at the end, with no check firing
        comm.require_same(q, "the L-BFGS iterates", "give every rank the same problem and settings")
        unit.zero_grad()
        unit.reduce_grad({"q": gradient(q, operator, readings)}, weight=rows)
        penalty = 0.5 * SMOOTH * G * float(np.diff(q) @ np.diff(q))
        misfit = objective(q, operator, readings) - penalty  # this rank's mean data term
        value = comm.all_reduce_scalar(rows * misfit, what="the misfit") / total + penalty
        return value, unit.gather(unit.grad_shard)["q"].copy()

    with unit.unsharded() as p:
        start = p["q"].copy()
    result = minimize(value_and_gradient, start, jac=True, method="L-BFGS-B", options={"maxiter": 500})
    with unit.unsharded(writeback=True) as p:
        p["q"][...] = result.x
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save", default="", help="a directory for checkpoints (saved at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--lbfgs", action="store_true", help="SciPy's L-BFGS instead of momentum SGD")
    parser.add_argument(
        "--deterministic", action="store_true", help="the same bits at any N dividing 12 (exact chunk sums)"
    )
    args = parser.parse_args()
    if args.deterministic:
        ignored = [
            flag
            for flag, given in (("--save", args.save), ("--resume", args.resume), ("--lbfgs", args.lbfgs))
            if given
        ]
        if ignored:  # they were ignored, silently
            parser.error(f"--deterministic runs momentum SGD without checkpoints: drop {', '.join(ignored)}")
        return deterministic(args.steps)

    comm = Comm()
    operator, readings, truth = problem()
    mine = tuple(rank_slice(a, comm.rank, comm.size, even=False) for a in (operator, readings))
    unit = Unit("source", {"q": np.zeros(G)}, comm)  # this rank keeps 1/N of q and of its momentum
    if args.lbfgs:
        from scipy.optimize import minimize

        result = lbfgs(unit, comm, *mine)
        want = minimize(lambda q: (objective(q, operator, readings), gradient(q, operator, readings)),
                        np.zeros(G), jac=True, method="L-BFGS-B", options={"maxiter": 500}).x  # fmt: skip
        q = full_state_dict(unit)["q"]
        if comm.rank == 0:
            print(f"L-BFGS: {result.nit} iterations, misfit to the true source {np.abs(q - truth).max():.3f}")
            print(f"max difference from plain NumPy: {np.abs(q - want).max():.2e}")
        return
    opt = SGD([unit], lr=LR, momentum=MOMENTUM)
    first = 0
    if args.resume:
        path, extra = checkpoint.load_latest(args.save, [unit], opt, missing_ok=True)  # a first run
        first = extra["step"] if path else 0
    for _ in range(first, args.steps):
        with unit.unsharded() as p:
            grads = {"q": gradient(p["q"], *mine)}
        # weighted by the rows: sum_r n_r g_r / sum_r n_r is the gradient over all 997 rows (the
        # penalty, the same on every rank, comes through once: the weights sum to their total)
        unit.reduce_grad(grads, weight=len(mine[1]))
        opt.step()
        opt.zero_grad()
    if args.save:
        checkpoint.save_step(args.save, args.steps, [unit], opt)
    q = full_state_dict(unit)["q"]
    error = np.abs(q - reference(args.steps, operator, readings)).max()
    if comm.rank == 0:
        rows = [len(rank_slice(readings, r, comm.size, even=False)) for r in range(comm.size)]
        print(f"{comm.size} ranks with {rows} sensor rows, steps {first}..{args.steps}")
        print(f"misfit to the true source {np.abs(q - truth).max():.3f} (of a peak of {truth.max():.2f})")
        print(f"max difference from plain NumPy: {error:.2e}")


def deterministic(steps: int):
    """Momentum SGD as main(), with the sensors' rows in CHUNKS fixed chunks: each rank adds the
    gradients of its chunks (each its rows' mean, weighed by its rows) to an exact sum, so the result
    does not depend on which rank held which chunk, nor on N."""
    comm = Comm()
    if CHUNKS % comm.size:
        raise SystemExit(f"--deterministic runs on a number of ranks dividing {CHUNKS}, not {comm.size}")
    operator, readings, truth = problem()
    chunks = np.array_split(np.arange(SENSORS), CHUNKS)
    mine = chunks[comm.rank * CHUNKS // comm.size : (comm.rank + 1) * CHUNKS // comm.size]
    unit = Unit("source", {"q": np.zeros(G)}, comm, deterministic=True)
    opt = SGD([unit], lr=LR, momentum=MOMENTUM)
    for _ in range(steps):
        with unit.unsharded() as p:
            for rows in mine:
                unit.add_chunk_grad({"q": gradient(p["q"], operator[rows], readings[rows])}, weight=len(rows))
        unit.reduce_chunk_grads()
        opt.step()
        opt.zero_grad()
    q = full_state_dict(unit)["q"]
    error = np.abs(q - reference(steps, operator, readings)).max()
    if comm.rank == 0:
        print(f"{comm.size} ranks, {len(mine)} of {CHUNKS} chunks each, {steps} steps")
        print(f"misfit to the true source {np.abs(q - truth).max():.3f}; from plain NumPy {error:.2e}")
        print(f"bits of the source: {hashlib.sha256(q.tobytes()).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
