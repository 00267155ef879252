"""The optimizer base on flat 1-D vectors: groups, global gradient norm and clipping, NaN/Inf policy,
per-group step counts and state, the state accessor checkpoints use. optimizers.py: AdamW, Adam, SGD.

The optimizer sees only *flat groups* (FlatGroup below): a plain Param is one group (WholeParam); an
FSDP Unit's shard is one group (its decay segments come from the layout). So the sharded optimizer is
the same arithmetic on a slice, and results match the unsharded run to the last bit of elementwise math.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import numpy as np

from ..autodiff.tensor import Param
from ..base.backend import array_module_of
from ..base.logs import job_warning
from ..shard.exact import exact_squared_norm
from .device import on_device
from .offload import DiskStates
from .verdict import StepVerdict

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """A NaN or Inf gradient, detected on every rank at once."""


class FlatGroup(Protocol):
    """What an optimizer steps: a 1-D parameter vector, its gradient, and where weight decay applies.
    Unit (unit.py) is one; WholeParam below is another; a user's own object may be a third."""

    name: str
    numel: int
    comm: object  # a Comm when the vector is a shard (the gradient norm is then global), else None
    ledger: object  # a MemoryLedger to count the optimizer's state in, or None

    def decay_segments(self, decays) -> list[tuple[int, int]]: ...
    def flat_param(self): ...
    def flat_grad(self): ...  # None when there is no gradient this step
    def zero_grad(self): ...


class WholeParam:
    """A whole, unsharded Param as one flat group."""

    comm = ledger = None

    def __init__(self, param: Param):
        self.param = param
        self.numel = param.size

    @property
    def name(self) -> str:
        return self.param.name

    def decay_segments(self, decays) -> list[tuple[int, int]]:
        return [(0, self.param.size)] if decays(self.param.name, self.param.shape) else []

    def _whole(self) -> Param:
        if self.param.absent is not None:
            raise RuntimeError(
                f"parameter {self.param.name!r} has no data ({self.param.absent}). Was the optimizer "
                "built before fully_shard()? Build it after, from the model: AdamW(model)."
            )
        return self.param

    def flat_param(self):
        return self._whole().data.reshape(-1)

    def flat_grad(self):
        grad = self._whole().grad
        return None if grad is None else grad.reshape(-1)

    def zero_grad(self):
        self.param.grad = None


class FlatOptimizer:
    """What every optimizer here shares: flat groups (Params, or FSDP Units once sharded), the global
    gradient norm and clipping, the NaN/Inf policy, a step count per group, the schedule check, and
    per-group state arrays named by `STATE` (allocated at a group's first step with a gradient).

    `targets` is a Module, a list of Params, or a list of flat groups. `comm`, when given (sharded
    groups bring theirs), makes the gradient norm global with one all_reduce of a scalar. `decay`
    chooses the tensors that get weight decay: "all", "matrices" (ndim >= 2), or a function
    (name, shape) -> bool. Subclasses implement `_update(i, p, g, state, step)`.
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
        self.comm = comm if comm is not None else self.groups[0].comm
        self.skipped_steps = 0
        self._norm = None  # the global grad norm of this step, once computed
        self.verdict = StepVerdict(self.groups, self.comm)  # the step's device checks and their one read
        self.step_count = 0  # steps taken (skipped ones not counted)
        # Each group's own step, as PyTorch's per-parameter state["step"]: a group first stepped at
        # step k gets the bias corrections of its first step, not of step k.
        self._steps = [0] * len(self.groups)
        self._grad_scale = 1.0  # this step's, for an _update that applies it (folds_grad_scale)
        self._state: list[dict] = [{} for _ in self.groups]  # per group: kind -> array, once allocated
        self.held_by = None  # a CUDA graph's DeviceStep that takes the steps (optim/device_step.py)
        self.on_disk = _disk_states(self.STATE, self.groups)  # offload="disk": DiskStates

    # -- the state accessor: what checkpoints (and tests) read and restore ------------------------
    @property
    def state_kinds(self) -> tuple:
        """The names of the per-group state arrays (AdamW: exp_avg, exp_avg_sq)."""
        return self.STATE

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "weight_decay": self.weight_decay}

    def summary(self) -> dict:
        """What a checkpoint records of this optimizer besides its arrays (JSON): name, step counts
        (global and per group) and hyper-parameters (a graph's last step read first: `settled`)."""
        self.settled()
        return {
            "name": type(self).__name__,
            "step": self.step_count,
            "group_steps": {_name(g): n for g, n in zip(self.groups, self._steps)},
            **self.hyperparameters(),
        }

    def restore(self, summary: dict):
        """Take the step counts of a summary() (per-group ones missing: the global step)."""
        self.step_count = summary["step"]
        per_group = summary.get("group_steps", {})
        self._steps = [per_group.get(_name(g), summary["step"]) for g in self.groups]

    def state_of(self, target, allocate: bool = False) -> dict:
        """kind -> array of the state of `target` (one of `groups`, or the Param a group wraps): {}
        before its first step, unless allocate=True (zeros, e.g. to load a checkpoint into)."""
        return self.state_at(self._index(target), allocate)

    def state_at(self, i: int, allocate: bool = False) -> dict:
        """state_of group i (by its place in `groups`); on disk (offload="disk"), its file regions
        mapped (memmaps), the first time zeros."""
        if self.on_disk is not None:
            if allocate:
                self._state[i] = {"on_disk": True}
            return self.on_disk.arrays(i) if self._state[i] else {}
        if allocate and self.STATE and not self._state[i]:
            group = self.groups[i]
            p = group.flat_param()
            xp = array_module_of(p)
            self._state[i] = {kind: xp.zeros_like(p) for kind in self.STATE}
            _count(group, "alloc", "optim_state", len(self.STATE) * p.nbytes)
        return self._state[i]

    def group_step(self, i: int) -> int:
        """Group i's own step count (its bias corrections': a group first stepped late starts at 1)."""
        return self._steps[i]

    def set_group_step(self, i: int, steps: int):
        """Group i's step count as a graph's steps left it (optim/device_step.py)."""
        self._steps[i] = steps

    def forget_state(self, target):
        """Drop the state of `target` (as before its first step), e.g. when a checkpoint holds none."""
        i = self._index(target)
        if self.on_disk is not None and self._state[i]:
            self.on_disk.zero(i)
        elif self._state[i]:
            _count(self.groups[i], "free", "optim_state", sum(a.nbytes for a in self._state[i].values()))
        self._state[i] = {}

    def _index(self, target) -> int:
        for i, group in enumerate(self.groups):
            if group is target or (isinstance(group, WholeParam) and group.param is target):
                return i
        raise KeyError(f"{type(self).__name__} does not step {_name(target)!r}")

    def step(self, grad_scale: float = 1.0) -> bool:
        """Update every group that has a gradient; groups without one are left alone and their step
        count stays (as PyTorch). grad_scale: every gradient is multiplied by it first (LossScaler's
        unscale and clip in one; AdamW on a GPU does it inside its update, in the same pass).

        A NaN or Inf anywhere in the gradients (on any rank: the norm is global) raises
        NonFiniteError on every rank, or with nonfinite="skip" drops the step on every rank, logs a
        warning and counts it in `skipped_steps`. Without any gradient it updates nothing and the step
        count stays. Returns whether the parameters were updated. Sharded: also compares the ranks'
        collective schedules (one tiny allgather), so a rank that clipped alone is caught here.
        """
        name = type(self).__name__
        self.refuse_if_held()
        check_lr(name, self.lr)
        norm = self._norm if self._norm is not None else self.grad_norm(f"the gradient norm of {name}.step")
        self._norm = None
        self.verdict.settle()
        if self.comm is not None:  # every rank reached this step through the same collectives
            self.comm.check_schedule(phase="optimizer")
        if not math.isfinite(norm):
            if self.nonfinite == "raise":
                raise nonfinite_error(name, norm, self.step_count + 1)
            self.skipped_steps += 1
            job_warning(self.comm, log, "skipped step %d: gradient norm %s", self.step_count + 1, norm)
            return False
        grads = [group.flat_grad() for group in self.groups]
        if all(g is None for g in grads):
            log.warning("%s.step() without gradients: nothing updated (call backward() first)", name)
            return False
        self.step_count += 1
        if grad_scale != 1.0 and not self.folds_grad_scale():
            self.scale_grads(grad_scale)
            grad_scale = 1.0
        self._grad_scale = grad_scale
        updates = []
        for i, (group, g) in enumerate(zip(self.groups, grads)):
            if g is not None:
                self._steps[i] += 1
                updates.append((i, group.flat_param(), g, self._state_for_step(i), self._steps[i]))
        if self.on_disk is not None:
            self._update_streamed(updates)
        else:
            self._update_all(updates)
        return True

    def _state_for_step(self, i: int):
        """Group i's state for this step's update: its arrays, or (on disk) None, read in turn by
        _update_streamed (the group marked as having a state)."""
        if self.on_disk is None:
            return self.state_at(i, allocate=True)
        self._state[i] = {"on_disk": True}
        return None

    def _update_streamed(self, updates: list):
        """Each update with its group's state read from disk in turn, the next read ahead and the
        last written back meanwhile (one group's state in memory at a time)."""
        by_group = {update[0]: update for update in updates}
        for i, state in self.on_disk.streamed(list(by_group)):  # run out: the last write waited for
            _, p, g, _, step = by_group[i]
            self._update(i, p, g, state, step)

    def refuse_if_held(self):
        """Refuse a step of the host's while a CUDA graph holds this optimizer's step (GraphedPasses
        given it: optim/device_step.py), which would count a step the device never took."""
        if self.held_by is not None:
            raise RuntimeError(
                f"{type(self).__name__}.step(): {self.held_by} takes this optimizer's steps (its calls "
                "need no step and no zero_grad)"
            )

    def settled(self):
        """The host's counts brought up to date where a graph holds the step (its last step's verdict
        read: optim/device_step.py DeviceStep.settle), before they are read or saved."""
        if self.held_by is not None:
            self.held_by.settle()

    def _update_all(self, updates: list):
        """Every (i, p, g, state, step) of this step's groups, in order (one launch for all on a GPU
        where the optimizer can: AdamW)."""
        for update in updates:
            self._update(*update)

    def _update(self, i: int, p, g, state: dict, step: int):
        """Update group i's flat vector p in place from gradient g; `step` is the group's own count."""
        raise NotImplementedError

    def folds_grad_scale(self) -> bool:
        """Whether _update applies step()'s grad_scale itself (self._grad_scale); else step() scales
        the gradients first."""
        return False

    def zero_grad(self):
        # this step's verdict goes with its gradients
        self._norm = None
        self.verdict.forget()
        for group in self.groups:
            group.zero_grad()

    def grad_norm(self, what: str = "the gradient norm") -> float:
        """The L2 norm of all gradients (across ranks when a comm is set; `what` is its purpose in the
        collective's fingerprint)."""
        grads = [group.flat_grad() for group in self.groups]
        if self.comm is not None and any(getattr(group, "deterministic", False) for group in self.groups):
            return math.sqrt(exact_squared_norm(self.comm, grads))  # the same bits at any N
        local = self._sum_of_squares([g for g in grads if g is not None])
        if self.comm is None:
            return math.sqrt(local)
        return math.sqrt(self.comm.all_reduce_scalar(local, phase="optimizer", what=what))

    def _sum_of_squares(self, grads) -> float:
        """Sum over the gradients of g @ g, in float64 in the order of Python's sum. A device's sums
        (cuda/norm.py: every group's in two launches) are read with the step's verdict, in one host
        sync (verdict.py)."""
        if not grads:
            return 0.0
        sums = on_device("sums_of_squares", grads[0])
        if sums is None:
            return float(sum((g @ g).astype(np.float64) for g in grads))
        (read,) = self.verdict.read_with([sums(grads)], "the step's verdict")
        return float(sum(read.astype(np.float64)))

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
        clip_scale(max_norm, 0.0)  # max_norm checked before the norm costs a collective
        norm = self.grad_norm("the gradient norm of clip_grad_norm") if norm is None else norm
        self.set_grad_norm(norm)
        scale = clip_scale(max_norm, norm)
        if scale < 1.0:
            self.scale_grads(scale)
        return norm

    def _add_l2(self, i: int, p, g):
        """Coupled L2 (Adam, SGD): g += weight_decay * p on the decaying tensors, in place."""
        if self.weight_decay:
            for start, stop in self.decay_segments[i]:
                g[start:stop] += self.weight_decay * p[start:stop]


def check_lr(name: str, lr: float):
    """Refuse an lr a step cannot take, naming the optimizer."""
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{name}.lr is {lr}: it must be a finite number >= 0 (check the lr schedule)")


def nonfinite_error(name: str, norm: float, step: int, why: str = "") -> NonFiniteError:
    """The error of a step whose global gradient norm is not finite under nonfinite='raise'."""
    return NonFiniteError(
        f"the gradient norm is {norm} at step {step}: a NaN or Inf reached the gradients (on at least "
        f"one rank){why}. {name}(nonfinite='skip') drops such steps instead."
    )


def clip_scale(max_norm: float, norm: float) -> float:
    """The factor clipping a gradient of global norm `norm` to at most max_norm (1.0: no clipping)."""
    if not (0 < max_norm < math.inf):
        raise ValueError(f"clip_grad_norm: max_norm must be a finite number > 0, got {max_norm}")
    return min(1.0, max_norm / (norm + 1e-6))


def _disk_states(kinds: tuple, groups: list):
    """DiskStates where the groups are the units of a model built with offload="disk" (fully_shard
    gives each unit its Offload and the job's Comm), made on every rank or refused on every rank
    (a directory missing on one node, a disk full there), else None."""
    offload, world = getattr(groups[0], "offload", None) or (None, None)
    if offload is None or offload.kind != "disk" or not kinds:
        return None
    if any(getattr(g, "offload", (None,))[0] != offload for g in groups):
        raise ValueError("an optimizer with offload='disk' steps the units of one model: AdamW(model)")
    make = lambda: DiskStates(offload.directory, kinds, groups, world.rank)  # noqa: E731
    states = world.run_everywhere(make, "offload='disk'", error_type=ValueError)
    _count(groups[0], "alloc", "optim_state", states.buffer_bytes)  # in memory: its two buffers a kind
    if groups[0].ledger is not None:  # in files: beside memory, not in its totals
        groups[0].ledger.on_disk["optim_state"] += states.nbytes
    return states


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


def _same(a, b) -> bool:
    return a is b or (isinstance(a, WholeParam) and isinstance(b, WholeParam) and a.param is b.param)


def _name(group) -> str:
    return group.name if hasattr(group, "name") else repr(group)


def _count(group, action: str, category: str, nbytes: int):
    """Record optimizer buffers in the group's memory ledger (sharded Units have one)."""
    if group.ledger is not None:
        getattr(group.ledger, action)(category, nbytes)


def _flat_groups(targets) -> list:
    sharded = getattr(targets, "_sharded", None)  # fully_shard's ShardedModel (nn.Module._sharded)
    if sharded is not None:  # a sharded model: its trainable units' shards are the flat groups
        return sharded.trainable_units
    if hasattr(targets, "parameters"):  # a model: its trainable parameters (frozen ones have no state)
        targets = [p for p in targets.parameters() if p.requires_grad]
    one = hasattr(targets, "flat_param") or isinstance(targets, Param)  # a Unit or a Param alone
    if one or not hasattr(targets, "__iter__"):
        what = type(targets).__name__
        raise TypeError(
            f"an optimizer takes a Module, a list of Params or a list of Units, not {what}"
            + (f": pass a list, [{what.lower()}]" if one else "")
        )
    return [WholeParam(t) if isinstance(t, Param) else t for t in targets]
