"""AdamW, Adam and SGD: the arithmetic of one step on a flat vector (flat_optimizer.py has the rest)."""

from __future__ import annotations

import math

import numpy as np

from ..base.backend import array_module_of
from ..base.checks import is_finite_at_least, refuse_invalid
from ..base.threads import for_row_blocks
from .device import on_device
from .flat_optimizer import FlatOptimizer, NonFiniteError

__all__ = ["SGD", "Adam", "AdamW", "NonFiniteError", "adamw_update"]


SLICE = 1 << 16  # elements updated at a time: the temporary stays small and in cache


def adamw_update(
    p, g, m, v, *, lr, beta1, beta2, eps, step, decay_segments=(), weight_decay=0.0, grad_scale=1.0
):
    """One AdamW step, in place, on 1-D arrays (p, m, v updated; g read, and first multiplied by
    grad_scale in place where that is not 1).

    Decoupled decay (p *= 1 - lr*wd) only inside decay_segments, then bias-corrected moments as in
    PyTorch's AdamW. The update, decay included, runs slice by slice (in parallel over the rank's
    threads) with one slice-sized temporary: no buffer of the model's size is allocated per step,
    and p is read and written once. A zero gradient where m and v are zero leaves p unchanged,
    which keeps FSDP padding at zero (docs/design.md, invariant 2). A device with its own update
    (device.py: a GPU's one kernel) runs that instead.
    """
    xp = array_module_of(p)
    decay = 1.0 - lr * weight_decay
    segments = list(decay_segments) if weight_decay else []
    bias1, bias2 = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
    own = on_device("adamw_update", p)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, weight_decay=weight_decay)
    if own is not None and own(p, g, m, v, decay_segments=segments, grad_scale=grad_scale, **hyper):
        return
    if grad_scale != 1.0:
        g *= grad_scale

    def update(lo, hi, s):
        s = s[: hi - lo]
        gs, ms, vs = g[lo:hi], m[lo:hi], v[lo:hi]
        xp.multiply(gs, 1.0 - beta1, out=s)
        ms *= beta1
        ms += s
        xp.multiply(gs, gs, out=s)
        s *= 1.0 - beta2
        vs *= beta2
        vs += s
        xp.sqrt(vs, out=s)
        s /= bias2
        s += eps
        xp.divide(ms, s, out=s)
        s *= lr / bias1
        for start, stop in segments:  # the decay, while this slice of p is in cache
            if start < hi and lo < stop:
                p[max(start, lo) : min(stop, hi)] *= decay
        p[lo:hi] -= s

    def block(i, lo, hi):
        s = np.empty(min(SLICE, hi - lo), dtype=p.dtype)
        for start in range(lo, hi, SLICE):
            update(start, min(start + SLICE, hi), s)

    for_row_blocks(p.size, 1, block)


class AdamW(FlatOptimizer):
    """AdamW with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.

    Defaults are torch's: betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on every tensor; our GPT
    examples pass nanoGPT's betas (0.9, 0.95) and decay="matrices" (ndim >= 2) explicitly.
    """

    STATE = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        targets,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.01,
        decay="all",
        comm=None,
        nonfinite="raise",
    ):
        _check_hyperparameters(type(self).__name__, lr, betas, eps, weight_decay)
        super().__init__(targets, lr, weight_decay, decay, comm, nonfinite)
        (self.beta1, self.beta2), self.eps = betas, eps

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "betas": [self.beta1, self.beta2], "eps": self.eps}

    def _update(self, i, p, g, state, step):
        adamw_update(
            p,
            g,
            state["exp_avg"],
            state["exp_avg_sq"],
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            step=step,
            decay_segments=self._decoupled(i),
            weight_decay=self.weight_decay,
            grad_scale=self._grad_scale,
        )

    def _update_all(self, updates: list):
        """Every group's update at once where the device has that (device.py: a GPU's one launch;
        AdamW's own update only: a subclass that changes it, as Adam does, updates group by group)."""
        together = on_device("adamw_step_all", updates[0][1]) if updates else None
        if type(self)._update is not AdamW._update or together is None or not together(self, updates):
            super()._update_all(updates)

    def hyperparameters_at(self, step: int) -> dict:
        """adamw_update's keywords for a group at its own `step` (this step's grad_scale included)."""
        return dict(
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            step=step,
            weight_decay=self.weight_decay,
            grad_scale=self._grad_scale,
        )

    def decayed(self, i) -> list:
        """Group i's decoupled decay segments this step (none without weight decay)."""
        return list(self._decoupled(i)) if self.weight_decay else []

    def folds_grad_scale(self) -> bool:
        """Where the device's update multiplies the gradient by step()'s grad_scale in its own pass
        (a GPU's kernel)."""
        return all(on_device("adamw_update", group.flat_param()) is not None for group in self.groups)

    def _decoupled(self, i):
        return self.decay_segments[i]


class Adam(AdamW):
    """Adam with coupled L2 regularization, as torch.optim.Adam: the decay term weight_decay * p is
    added to the gradient (in place) before the moments see it. Defaults: no decay."""

    def __init__(self, targets, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decay="all", **kw):
        super().__init__(targets, lr, betas, eps, weight_decay, decay, **kw)

    def _update(self, i, p, g, state, step):
        self._add_l2(i, p, g)
        super()._update(i, p, g, state, step)

    def folds_grad_scale(self) -> bool:
        return False  # the L2 term joins the gradient after it is scaled

    def _decoupled(self, i):
        return ()


class SGD(FlatOptimizer):
    """SGD with momentum (and Nesterov), coupled weight decay, as torch.optim.SGD (no dampening):
    buf = momentum * buf + g;  step = g + momentum * buf (Nesterov) or buf;  p -= lr * step."""

    def __init__(
        self,
        targets,
        lr=1e-3,
        momentum=0.0,
        nesterov=False,
        weight_decay=0.0,
        decay="all",
        comm=None,
        nonfinite="raise",
    ):
        refuse_invalid(
            "SGD",
            *_rate_and_decay(lr, weight_decay),
            (is_finite_at_least(momentum, 0) and momentum < 1, f"momentum={momentum} (in [0, 1))"),
            (not (nesterov and momentum == 0), "nesterov=True needs momentum > 0"),
        )
        self.STATE = ("momentum_buffer",) if momentum else ()
        super().__init__(targets, lr, weight_decay, decay, comm, nonfinite)
        self.momentum, self.nesterov = momentum, nesterov

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "momentum": self.momentum, "nesterov": self.nesterov}

    def _update(self, i, p, g, state, step):
        self._add_l2(i, p, g)
        if self.momentum:
            buf = state["momentum_buffer"]
            if step == 1:
                buf[...] = g  # torch starts the buffer at the first gradient
            else:
                buf *= self.momentum
                buf += g
            if self.nesterov:
                g += self.momentum * buf
            else:
                g = buf
        p -= self.lr * g


def _rate_and_decay(lr, weight_decay) -> list[tuple[bool, str]]:
    """The checks every optimizer makes of its learning rate and weight decay."""
    return [
        (is_finite_at_least(lr, 0), f"lr={lr} (a finite number >= 0)"),
        (is_finite_at_least(weight_decay, 0), f"weight_decay={weight_decay} (a finite number >= 0)"),
    ]


def _check_hyperparameters(name, lr, betas, eps, weight_decay):
    refuse_invalid(
        name,
        *_rate_and_decay(lr, weight_decay),
        (
            len(betas) == 2 and all(0 <= b < 1 for b in betas),
            f"betas={betas} (two numbers in [0, 1))",
        ),
        (is_finite_at_least(eps, 0) and eps > 0, f"eps={eps} (a finite number > 0)"),
    )
