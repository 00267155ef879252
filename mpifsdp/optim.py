"""Optimizers on flat 1-D vectors (AdamW, Adam, SGD), and global gradient-norm clipping.

The optimizer sees only *flat groups*: objects with a 1-D parameter vector, a 1-D gradient vector
and the segments of that vector that get weight decay. A plain Param is one group; an FSDP Unit's
shard is one group (its segments come from the layout). So the sharded optimizer is the same
arithmetic on a slice, and results match the unsharded run to the last bit of elementwise math.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .autodiff import Param
from .backend import array_module_of
from .fsdp import fsdp_group
from .threads import for_row_blocks

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """A NaN or Inf gradient, detected on every rank at once."""


class ParamGroup:
    """A whole, unsharded parameter seen as one flat group."""

    def __init__(self, param: Param):
        self.param = param
        self.numel = param.size

    def decay_segments(self, decays) -> list[tuple[int, int]]:
        return [(0, self.param.size)] if decays(self.param.name, self.param.shape) else []

    def _whole(self) -> Param:
        if self.param.unit_name is not None:
            raise RuntimeError(
                f"AdamW was built before fully_shard(): parameter {self.param.name!r} now lives only as a "
                "shard of its unit. Build the optimizer after sharding: AdamW(model)."
            )
        return self.param

    def flat_param(self):
        return self._whole().data.reshape(-1)

    def flat_grad(self):
        grad = self._whole().grad
        return None if grad is None else grad.reshape(-1)

    def zero_grad(self):
        self.param.grad = None


SLICE = 1 << 16  # elements updated at a time: the temporary stays small and in cache


def adamw_update(p, g, m, v, *, lr, beta1, beta2, eps, step, decay_segments=(), weight_decay=0.0):
    """One AdamW step, in place, on 1-D arrays (p, m, v updated; g read).

    Decoupled decay (p *= 1 - lr*wd) only inside decay_segments, then bias-corrected moments as in
    PyTorch's AdamW. The update runs slice by slice (in parallel over the rank's threads on the CPU)
    with one slice-sized temporary: no buffer of the model's size is allocated per step. A zero
    gradient where m and v are zero leaves p unchanged, which keeps FSDP padding at zero (docs/design.md,
    invariant 2).
    """
    xp = array_module_of(p)
    if weight_decay:
        for start, stop in decay_segments:
            p[start:stop] *= 1.0 - lr * weight_decay
    bias1, bias2 = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)

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
        p[lo:hi] -= s

    if xp is not np:  # a GPU updates the whole vector at once
        update(0, p.size, xp.empty_like(p))
        return

    def block(i, lo, hi):
        s = np.empty(min(SLICE, hi - lo), dtype=p.dtype)
        for start in range(lo, hi, SLICE):
            update(start, min(start + SLICE, hi), s)

    for_row_blocks(p.size, 1, block)


class FlatOptimizer:
    """What every optimizer here shares: flat groups (Params, or FSDP Units once sharded), the global
    gradient norm and clipping, the NaN/Inf policy, a step count per group, the schedule check, and
    per-group state arrays named by `STATE` (allocated at a group's first step with a gradient).

    `targets` is a Module, a list of Params, or a list of flat groups. `comm`, when given (sharded
    groups bring theirs), makes the gradient norm global with one all_reduce of a scalar. `decay`
    chooses the tensors that get weight decay: "all", "matrices" (ndim >= 2), or a function
    (name, shape) -> bool. Subclasses implement `_update(i, p, g, state)`.
    """

    STATE: tuple = ()

    def __init__(self, targets, lr, weight_decay, decay, comm, nonfinite):
        name = type(self).__name__
        self.groups = _flat_groups(targets)
        if not self.groups:
            raise ValueError(f"{name} got no parameters to optimize")
        twice = sorted({_name(g) for g in self.groups if sum(_same(g, h) for h in self.groups) > 1})
        if twice:
            raise ValueError(f"{name} got {twice} more than once: each parameter or unit is stepped once")
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.lr, self.weight_decay, self.nonfinite = lr, weight_decay, nonfinite
        self.decay_segments = [group.decay_segments(_decay_filter(decay)) for group in self.groups]
        # Sharded groups (Units) carry their communicator: the gradient norm must then be global.
        self.comm = comm if comm is not None else getattr(self.groups[0], "comm", None)
        self.skipped_steps = 0
        self._norm = None  # the global grad norm of this step, once computed
        self.step_count = 0  # steps taken (skipped ones not counted)
        # Each group's own step, as PyTorch's per-parameter state["step"]: a group first stepped at
        # step k gets the bias corrections of its first step, not of step k.
        self.steps = [0] * len(self.groups)
        self.state = {kind: [None] * len(self.groups) for kind in self.STATE}

    def hyperparameters(self) -> dict:
        """What a checkpoint records of this optimizer besides its state."""
        return {"lr": self.lr, "weight_decay": self.weight_decay}

    def saved_state(self, i) -> dict:
        """kind -> array of group i's state, or {} before its first step (what a checkpoint saves)."""
        allocated = self.STATE and self.state[self.STATE[0]][i] is not None
        return {kind: self.state[kind][i] for kind in self.STATE} if allocated else {}

    def state_of(self, i) -> dict:
        """kind -> array of group i's state, allocated (zeros) at the first call."""
        if self.STATE and not self.saved_state(i):
            group = self.groups[i]
            p = group.flat_param()
            xp = array_module_of(p)
            for kind in self.STATE:
                self.state[kind][i] = xp.zeros_like(p)
            _count(group, "alloc", "optim_state", len(self.STATE) * p.nbytes)
        return self.saved_state(i)

    def reset_state(self, i):
        """Forget group i's state (as before its first step), e.g. when a checkpoint holds none for it."""
        state = self.saved_state(i)
        for kind in state:
            self.state[kind][i] = None
        if state:
            _count(self.groups[i], "free", "optim_state", sum(a.nbytes for a in state.values()))

    def step(self) -> bool:
        """Update every group that has a gradient; groups without one are left alone and their step
        count stays (as PyTorch).

        A NaN or Inf anywhere in the gradients (on any rank: the norm is global) raises
        NonFiniteError on every rank, or with nonfinite="skip" drops the step on every rank, logs a
        warning and counts it in `skipped_steps`. Without any gradient it updates nothing and the step
        count stays. Returns whether the parameters were updated. Sharded: also compares the ranks'
        collective schedules (one tiny allgather), so a rank that clipped alone is caught here.
        """
        name = type(self).__name__
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(
                f"{name}.lr is {self.lr}: it must be a finite number >= 0 (check the lr schedule)"
            )
        norm = self._norm if self._norm is not None else self.grad_norm(f"the gradient norm of {name}.step")
        self._norm = None
        if self.comm is not None:  # every rank reached this step through the same collectives
            self.comm.check_schedule(phase="optimizer")
        if not math.isfinite(norm):
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    f"the gradient norm is {norm} at step {self.step_count + 1}: a NaN or Inf reached the "
                    f"gradients (on at least one rank). {name}(nonfinite='skip') drops such steps instead."
                )
            self.skipped_steps += 1
            log.warning("skipped step %d: gradient norm %s", self.step_count + 1, norm)
            return False
        grads = [group.flat_grad() for group in self.groups]
        if all(g is None for g in grads):
            log.warning("%s.step() without gradients: nothing updated (call backward() first)", name)
            return False
        self.step_count += 1
        for i, (group, g) in enumerate(zip(self.groups, grads)):
            if g is not None:
                self.steps[i] += 1
                self._update(i, group.flat_param(), g, self.state_of(i))
        return True

    def _update(self, i: int, p, g, state: dict):
        raise NotImplementedError

    def zero_grad(self):
        self._norm = None
        for group in self.groups:
            group.zero_grad()

    def grad_norm(self, what: str = "the gradient norm") -> float:
        """The L2 norm of all gradients (across ranks when a comm is set; `what` is its purpose in the
        collective's fingerprint)."""
        local = sum(float(g @ g) for g in (group.flat_grad() for group in self.groups) if g is not None)
        if self.comm is None:
            return math.sqrt(local)
        return math.sqrt(self.comm.all_reduce_scalar(local, phase="optimizer", what=what))

    def scale_grads(self, factor: float):
        """Multiply every gradient this optimizer steps by `factor`, in place."""
        for group in self.groups:
            g = group.flat_grad()
            if g is not None:
                g *= factor

    def set_grad_norm(self, norm: float):
        """This step's global gradient norm, computed by the caller: step() then checks it instead of
        all-reducing again (zero_grad and step forget it)."""
        self._norm = norm

    def clip_grad_norm(self, max_norm: float, norm: float | None = None) -> float:
        """Scale gradients so their global norm is at most max_norm; returns the norm before clipping.

        `norm`: the current global norm when the caller already has it (saves a pass and an all_reduce).
        """
        if not (0 < max_norm < math.inf):
            raise ValueError(f"clip_grad_norm: max_norm must be a finite number > 0, got {max_norm}")
        norm = self.grad_norm("the gradient norm of clip_grad_norm") if norm is None else norm
        self.set_grad_norm(norm)
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            self.scale_grads(scale)
        return norm

    def _add_l2(self, i: int, p, g):
        """Coupled L2 (Adam, SGD): g += weight_decay * p on the decaying tensors, in place."""
        if self.weight_decay:
            for start, stop in self.decay_segments[i]:
                g[start:stop] += self.weight_decay * p[start:stop]


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

    @property
    def m(self) -> list:
        return self.state["exp_avg"]

    @property
    def v(self) -> list:
        return self.state["exp_avg_sq"]

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "betas": [self.beta1, self.beta2], "eps": self.eps}

    def _update(self, i, p, g, state):
        adamw_update(
            p, g, state["exp_avg"], state["exp_avg_sq"], lr=self.lr, beta1=self.beta1, beta2=self.beta2,
            eps=self.eps, step=self.steps[i], decay_segments=self._decoupled(i),
            weight_decay=self.weight_decay,
        )  # fmt: skip

    def _decoupled(self, i):
        return self.decay_segments[i]


class Adam(AdamW):
    """Adam with coupled L2 regularization, as torch.optim.Adam: the decay term weight_decay * p is
    added to the gradient (in place) before the moments see it. Defaults: no decay."""

    def __init__(self, targets, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decay="all", **kw):
        super().__init__(targets, lr, betas, eps, weight_decay, decay, **kw)

    def _update(self, i, p, g, state):
        self._add_l2(i, p, g)
        super()._update(i, p, g, state)

    def _decoupled(self, i):
        return ()


class SGD(FlatOptimizer):
    """SGD with momentum (and Nesterov), coupled weight decay, as torch.optim.SGD (no dampening):
    buf = momentum * buf + g;  step = g + momentum * buf (Nesterov) or buf;  p -= lr * step."""

    def __init__(
        self, targets, lr=1e-3, momentum=0.0, nesterov=False, weight_decay=0.0, decay="all",
        comm=None, nonfinite="raise",
    ):  # fmt: skip
        problems = [f"lr={lr}"] if not (math.isfinite(lr) and lr >= 0) else []
        problems += [f"momentum={momentum}"] if not 0 <= momentum < 1 else []
        problems += (
            [f"weight_decay={weight_decay}"]
            if not (math.isfinite(weight_decay) and weight_decay >= 0)
            else []
        )
        if nesterov and momentum == 0:
            problems.append("nesterov=True needs momentum > 0")
        if problems:
            raise ValueError(f"SGD: invalid {', '.join(problems)} (lr, weight_decay >= 0; 0 <= momentum < 1)")
        self.STATE = ("momentum_buffer",) if momentum else ()
        super().__init__(targets, lr, weight_decay, decay, comm, nonfinite)
        self.momentum, self.nesterov = momentum, nesterov

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "momentum": self.momentum, "nesterov": self.nesterov}

    def _update(self, i, p, g, state):
        self._add_l2(i, p, g)
        if self.momentum:
            buf = state["momentum_buffer"]
            if self.steps[i] == 1:
                buf[...] = g  # torch starts the buffer at the first gradient
            else:
                buf *= self.momentum
                buf += g
            if self.nesterov:
                g += self.momentum * buf
            else:
                g = buf
        p -= self.lr * g


def _decay_filter(decay):
    """decay="all" | "matrices" | (name, shape) -> bool, as a function."""
    if callable(decay):
        return decay
    filters = {"all": lambda name, shape: True, "matrices": lambda name, shape: len(shape) >= 2}
    if decay not in filters:
        raise ValueError(
            f"AdamW: decay must be 'all', 'matrices' or a function (name, shape) -> bool, got {decay!r}"
        )
    return filters[decay]


def _check_hyperparameters(name, lr, betas, eps, weight_decay):
    problems = []
    if not (math.isfinite(lr) and lr >= 0):
        problems.append(f"lr={lr} (a finite number >= 0)")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        problems.append(f"betas={betas} (two numbers in [0, 1))")
    if not (math.isfinite(eps) and eps > 0):
        problems.append(f"eps={eps} (a finite number > 0)")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        problems.append(f"weight_decay={weight_decay} (a finite number >= 0)")
    if problems:
        raise ValueError(f"{name}: invalid " + ", ".join(problems))


def _same(a, b) -> bool:
    return a is b or (isinstance(a, ParamGroup) and isinstance(b, ParamGroup) and a.param is b.param)


def _name(group) -> str:
    return group.param.name if isinstance(group, ParamGroup) else getattr(group, "name", repr(group))


def _count(group, action: str, category: str, nbytes: int):
    """Record optimizer buffers in the group's memory ledger (sharded Units have one)."""
    ledger = getattr(group, "ledger", None)
    if ledger is not None:
        getattr(ledger, action)(category, nbytes)


def _flat_groups(targets) -> list:
    group = fsdp_group(targets)
    if group is not None:  # a sharded model: its units' shards are the flat groups
        return group.units
    if hasattr(targets, "parameters"):
        targets = targets.parameters()
    return [ParamGroup(t) if isinstance(t, Param) else t for t in targets]
