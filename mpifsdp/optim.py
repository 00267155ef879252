"""AdamW on flat 1-D vectors, and global gradient-norm clipping.

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


class AdamW:
    """AdamW with decoupled weight decay, over flat groups (Params, or FSDP Units once sharded).

    `targets` is a Module, a list of Params, or a list of flat groups. `comm`, when given, makes
    clip_grad_norm global across ranks with one all_reduce of a scalar.
    Defaults are torch.optim.AdamW's: betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on every
    tensor. `decay` chooses the tensors that decay: "all", "matrices" (ndim >= 2: nanoGPT's choice,
    which our GPT examples pass), or a function (name, shape) -> bool.
    """

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
        self.groups = _flat_groups(targets)
        if not self.groups:
            raise ValueError("AdamW got no parameters to optimize")
        _check_hyperparameters(lr, betas, eps, weight_decay)
        twice = sorted({_name(g) for g in self.groups if sum(_same(g, h) for h in self.groups) > 1})
        if twice:
            raise ValueError(f"AdamW got {twice} more than once: each parameter or unit is stepped once")
        self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.decay_segments = [group.decay_segments(_decay_filter(decay)) for group in self.groups]
        # Sharded groups (Units) carry their communicator: clipping must then be global.
        self.comm = comm if comm is not None else getattr(self.groups[0], "comm", None)
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._norm = None  # the global grad norm of this step, once computed
        self.step_count = 0  # steps taken (skipped ones not counted)
        # Each group's own step, as PyTorch's per-parameter state["step"]: a group first stepped at
        # step k gets the bias corrections of its first step, not of step k.
        self.steps = [0] * len(self.groups)
        self.m = [None] * len(self.groups)
        self.v = [None] * len(self.groups)

    def _moments(self, i):
        if self.m[i] is None:  # allocated at the first step that has a gradient for this group
            group = self.groups[i]
            p = group.flat_param()
            xp = array_module_of(p)
            self.m[i], self.v[i] = xp.zeros_like(p), xp.zeros_like(p)
            _count(group, "alloc", "optim_state", 2 * p.nbytes)
        return self.m[i], self.v[i]

    def step(self) -> bool:
        """Update every group that has a gradient; groups without one are left alone and their step
        count stays (as PyTorch).

        A NaN or Inf anywhere in the gradients (on any rank: the norm is global) raises
        NonFiniteError on every rank, or with nonfinite="skip" drops the step on every rank, logs a
        warning and counts it in `skipped_steps`. Without any gradient it updates nothing and the step
        count stays. Returns whether the parameters were updated. Sharded: also compares the ranks'
        collective schedules (one tiny allgather), so a rank that clipped alone is caught here.
        """
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(
                f"AdamW.lr is {self.lr}: it must be a finite number >= 0 (check the lr schedule)"
            )
        norm = self._norm if self._norm is not None else self.grad_norm("the gradient norm of AdamW.step")
        self._norm = None
        if self.comm is not None:  # every rank reached this step through the same collectives
            self.comm.check_schedule(phase="optimizer")
        if not math.isfinite(norm):
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    f"the gradient norm is {norm} at step {self.step_count + 1}: a NaN or Inf reached the "
                    "gradients (on at least one rank). AdamW(nonfinite='skip') drops such steps instead."
                )
            self.skipped_steps += 1
            log.warning("skipped step %d: gradient norm %s", self.step_count + 1, norm)
            return False
        grads = [group.flat_grad() for group in self.groups]
        if all(g is None for g in grads):
            log.warning("AdamW.step() without gradients: nothing updated (call backward() first)")
            return False
        self.step_count += 1
        for i, (group, g) in enumerate(zip(self.groups, grads)):
            if g is None:
                continue
            m, v = self._moments(i)
            self.steps[i] += 1
            adamw_update(
                group.flat_param(),
                g,
                m,
                v,
                lr=self.lr,
                beta1=self.beta1,
                beta2=self.beta2,
                eps=self.eps,
                step=self.steps[i],
                decay_segments=self.decay_segments[i],
                weight_decay=self.weight_decay,
            )
        return True

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


def _check_hyperparameters(lr, betas, eps, weight_decay):
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
        raise ValueError("AdamW: invalid " + ", ".join(problems))


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


class LossScaler:
    """Dynamic loss scaling for float16 compute: scale the loss, unscale the gradients, skip overflows.

        scaler.scale(loss).backward()
        scaler.step(opt, max_norm=1.0)   # False when the step overflowed and was skipped
        opt.zero_grad()

    A step whose gradients overflow (a global check: every rank agrees) is skipped and the scale
    halved; after `growth_interval` good steps in a row the scale doubles. Skipping cannot go on
    unnoticed: `max_skips_in_a_row` overflowing steps in a row, or an overflow at `min_scale` (where
    halving cannot help), raise NonFiniteError on every rank.
    """

    def __init__(
        self,
        init_scale: float = 2.0**15,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        max_skips_in_a_row: int = 20,
    ):
        if not (0 < min_scale <= init_scale < math.inf) or growth_interval < 1 or max_skips_in_a_row < 1:
            raise ValueError(
                "LossScaler needs 0 < min_scale <= init_scale (finite), growth_interval >= 1 and "
                f"max_skips_in_a_row >= 1; got min_scale={min_scale}, init_scale={init_scale}, "
                f"growth_interval={growth_interval}, max_skips_in_a_row={max_skips_in_a_row}"
            )
        self.scale_value = float(init_scale)
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_skips_in_a_row = max_skips_in_a_row
        self.good_steps = 0
        self.skipped_steps = 0
        self.skips_in_a_row = 0

    def scale(self, loss):
        return loss * self.scale_value

    def step(self, optimizer: AdamW, max_norm: float | None = None) -> bool:
        optimizer.scale_grads(1.0 / self.scale_value)
        norm = optimizer.grad_norm()
        if not math.isfinite(norm):
            if self.scale_value <= self.min_scale or self.skips_in_a_row + 1 >= self.max_skips_in_a_row:
                raise NonFiniteError(
                    f"the gradients overflow at loss scale {self.scale_value:g} ({self.skips_in_a_row + 1} "
                    f"steps in a row, {self.skipped_steps + 1} in all): the loss or the model itself is "
                    "not finite in this precision; lower the lr, or compute in float32 or bfloat16"
                )
            self.skipped_steps += 1
            self.skips_in_a_row += 1
            self.good_steps = 0
            self.scale_value = max(self.min_scale, self.scale_value / 2)
            log.warning("loss scale overflow: skipped the step, scale now %g", self.scale_value)
            return False
        self.skips_in_a_row = 0
        if max_norm is not None:
            optimizer.clip_grad_norm(max_norm, norm=norm)
        optimizer.set_grad_norm(norm)  # one global norm a step
        optimizer.step()
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale_value *= 2
        return True
