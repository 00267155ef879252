"""Sharded training in a plain NumPy code, without mpifsdp's autodiff: fit a damped oscillator bank.

A scientist's model: K damped oscillators y(t) = sum_k a_k exp(-d_k t) cos(w_k t + p_k), plus a
linear read-out W (K x C) mapping the K signals to C observed channels. Gradients are written by
hand. Each rank holds 1/N of every parameter and of the optimizer state (mpifsdp.Unit), and its own
slice of the time samples; the only mpifsdp calls are unshard, reduce_grad and AdamW.step.

    mpiexec -n 4 python -m mpi4py examples/sharded_numpy.py
"""

from __future__ import annotations

import numpy as np

from mpifsdp import AdamW, Comm, Unit
from mpifsdp.data import rank_slice

K, C, SAMPLES, STEPS = 6, 40, 2400, 600


def signals(p, t):
    """(len(t), K) oscillator signals and what the gradient needs."""
    decay = np.exp(-np.outer(t, p["damping"]))
    phase = np.outer(t, p["freq"]) + p["phase"]
    return p["amp"] * decay * np.cos(phase), decay, phase


def loss_and_grads(p, t, y):
    """Mean squared error of the read-out and its gradient, by hand (the chain rule, written out)."""
    s, decay, phase = signals(p, t)
    r = s @ p["readout"] - y  # (T, C) residual
    n = r.size
    loss = float((r * r).sum() / n)
    g_out = 2 * r / n  # dL/d prediction
    g_s = g_out @ p["readout"].T  # dL/d signals (T, K)
    cos, sin = np.cos(phase), np.sin(phase)
    grads = {
        "readout": s.T @ g_out,
        "amp": (g_s * decay * cos).sum(0),
        "damping": (g_s * p["amp"] * decay * cos * -t[:, None]).sum(0),
        "freq": (g_s * p["amp"] * decay * -sin * t[:, None]).sum(0),
        "phase": (g_s * p["amp"] * decay * -sin).sum(0),
    }
    return loss, grads


def main():
    comm = Comm()
    truth_rng = np.random.default_rng(0)
    truth = {
        "amp": truth_rng.uniform(0.5, 2.0, K),
        "damping": truth_rng.uniform(0.05, 0.3, K),
        "freq": np.linspace(1.0, 3.5, K),
        "phase": truth_rng.uniform(-1, 1, K),
        "readout": truth_rng.standard_normal((K, C)),
    }
    t = np.linspace(0.0, 12.0, SAMPLES)
    y = signals(truth, t)[0] @ truth["readout"] + 0.01 * truth_rng.standard_normal((SAMPLES, C))
    t_mine, y_mine = rank_slice(t, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)

    # Start near the truth's frequencies (the usual spectral initial guess), everything else off.
    init_rng = np.random.default_rng(1)
    start = {
        "amp": np.ones(K),
        "damping": np.full(K, 0.1),
        "freq": truth["freq"] + init_rng.normal(0, 0.05, K),
        "phase": np.zeros(K),
        "readout": 0.1 * init_rng.standard_normal((K, C)),
    }
    unit = Unit("oscillators", start, comm)  # this rank keeps 1/N of the 264 numbers and their state
    opt = AdamW([unit], lr=0.02, betas=(0.9, 0.95), weight_decay=0.0)  # no decay: a physical fit
    for step in range(STEPS):
        with unit.unsharded() as p:  # Allgather: full parameters only inside this block
            loss, grads = loss_and_grads(p, t_mine, y_mine)
        unit.reduce_grad(grads)  # Reduce_scatter: mean gradient, this rank's slice only
        opt.step()
        opt.zero_grad()
        loss = comm.all_reduce_scalar(loss) / comm.size
        if comm.rank == 0 and (step % 100 == 0 or step == STEPS - 1):
            print(f"step {step:5d}  mse {loss:.5f}")
    fitted = unit.gather(unit.shard)
    if comm.rank == 0:
        print(f"{comm.size} ranks, each holding {unit.numel} of {unit.layout.numel} parameters")
        print("fitted damping", np.round(np.sort(fitted["damping"]), 3))
        print("true damping  ", np.round(np.sort(truth["damping"]), 3))
        print(f"final mse {loss:.5f} (noise floor {0.01**2:.5f})")


if __name__ == "__main__":
    main()
