"""The whole step on the device, for a CUDA graph that holds it (fsdp/graphed.py): DeviceStep.

Why: a graph of the forward and backward alone leaves the optimizer's step to the host, and that
step reads the gradient norm before it can decide anything (a host sync a step, the GPU idle while
Python decides, then the step's launches one by one). Here the decision moves to the device: the
norm's sums, their sum over the ranks, the verdict (finite? clip? the loss scale's skip, halving and
growth; a failed input check or gather cast), the step counts and AdamW's hyperparameters (the lr
from a device buffer the host writes when it changes, the bias corrections from each group's step)
are kernels the graph replays, and AdamW's update reads its row and a skip flag from them.

The host reads the state once a step, one step late (`settle`, before the next replay: the GPU
has finished by then or nearly), mirrors it into the optimizer and the scaler (step counts, scale,
skips: what checkpoints save) and raises what eager training would have raised, on every rank. Late
costs nothing: a step that must stop (a failed check, a norm not finite with nonfinite="raise", the
scale's overflow limits) notes the stop on the device and its own update does not run; the host
raises at its next read and refuses every call after it, so the parameters stay those before the
bad step, as eagerly.

The state is one float64 vector, PLACES by name (the kernels' S_* defines), then each stepped
group's step before the graph's first (its own bias corrections, as FlatOptimizer keeps them). The
host's view of it (its counts, scale and settings) is compared with what the device was last given
before every replay: an lr schedule, a restored checkpoint or a changed setting is uploaded then,
one small copy. While a graph holds the step, the optimizer's and the scaler's own step() refuse
(they would count a step the device never took), and what checkpoints read settles first.
"""

from __future__ import annotations

import logging

import numpy as np

from ..base import backend
from ..base.logs import job_warning
from .device import on_device
from .flat_optimizer import check_lr, clip_scale, nonfinite_error
from .optimizers import AdamW
from .scaler import overflow_error
from .verdict import verdict_arrays

log = logging.getLogger(__name__)

PLACES = (
    "scale",  # the loss scale (1 without a scaler)
    "good",  # the scaler's good steps in a row
    "skips_in_a_row",
    "skipped",  # skipped steps: the scaler's, or the optimizer's without one
    "taken",  # updates since the state was last given to the device
    "norm",  # this step's global gradient norm (unscaled)
    "factor",  # what the gradients were multiplied by (unscale and clip)
    "stop",  # STOPS: why the job must stop (0: it goes on)
    "dry",  # 1: the capture's check replay, which moves nothing and skips the update
    "lr",
    "max_norm",  # 0: no clipping
    "growth",
    "min_scale",
    "max_skips",
    "scaled",  # 1 with a LossScaler
    "raise",  # 1: a norm not finite stops the job (nonfinite="raise", no scaler)
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "groups",  # the first group's step before the state was given; one place a group from here
)
STOPS = ("none", "refused", "nonfinite", "scale")  # the kernels' STOP_* by their place here
GROUPS = PLACES.index("groups")


class DeviceStep:
    """An AdamW step (with a LossScaler and clipping where given) decided and run on the device by
    the kernels a graph replays (module docstring). Its moves: `eager` (the first call), `reference`
    and `prepare` (before the capture), `queue` (inside it), `checked_sums` and `arm` (the capture's
    check), `launched`, `settle` and `sync_host` (around every replay)."""

    def __init__(self, optimizer, scaler=None, max_norm=None):
        self.optimizer, self.scaler, self.max_norm = optimizer, scaler, max_norm
        self.kernels = self.state = None  # the device's kernels (optim/device.py "whole_step"); the state
        self.stepped: list = []  # the groups the graph steps (those the reference pass gave gradients)
        self._base = (0, [])  # the host's counts when the state was last given: (step_count, group steps)
        self._seen = None  # the host's view (_view) as the device was last given or left it
        self._checks = ([], [])  # the overflow flags and input checks the captured step reads
        self._tables = self._sums = None  # the kernels' address tables; the per-group sums in the graph
        self._pending = False  # a replay queued whose state the host has not read
        self._stopped = None  # what a step that stopped the job raised: every later call refused

    def __str__(self):
        return "a CUDA graph holding the whole step (GraphedPasses(..., optimizer=))"

    def refusal(self, units) -> str | None:
        """Why this step cannot be held in a graph, or None."""
        opt = self.optimizer
        if self.max_norm is not None:
            clip_scale(self.max_norm, 0.0)  # refused by its own message where not a finite number > 0
        if type(opt)._update is not AdamW._update or not opt.folds_grad_scale():
            return f"the whole step runs AdamW's update kernel; {type(opt).__name__} has its own update"
        if [id(g) for g in opt.groups] != [id(u) for u in units]:
            return "the optimizer must step exactly the model's trainable units: AdamW(model)"
        if on_device("whole_step", opt.groups[0].flat_param()) is None:
            return "this device has no kernels for the step's verdict"
        return None

    # -- the first call and the capture --------------------------------------------------------------
    def eager(self):
        """The step as eager training runs it (the graph's first call: every kernel built and
        checked), zero_grad, and every group's moments made (zeros until its first update) where
        the graph will address them."""
        opt, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.step(opt, max_norm=self.max_norm)
        else:
            if self.max_norm is not None:
                opt.clip_grad_norm(self.max_norm)
            opt.step()
        opt.zero_grad()
        for i in range(len(opt.groups)):
            opt.state_at(i, allocate=True)

    def reference(self) -> np.ndarray:
        """Each gradient's sum of squares after the reference passes, read with their checks (a bad
        batch raises here, before any capture): what the graph's own sums must equal."""
        opt = self.optimizer
        self.stepped = [i for i, group in enumerate(opt.groups) if group.flat_grad() is not None]
        grads = [opt.groups[i].flat_grad() for i in self.stepped]
        sums = on_device("sums_of_squares", grads[0])(grads)
        (sums,) = opt.verdict.read_with([sums], "a graph's reference")
        opt.verdict.settle()
        return np.asarray(sums, dtype=np.float64)

    def prepare(self):
        """Before the capture: the kernels ready, their tables written, the state on the device (in
        its dry form: the capture's check replay moves nothing), the optimizer and scaler held."""
        opt = self.optimizer
        self.kernels = on_device("whole_step", opt.groups[0].flat_param())()
        self._tables = self.kernels.ready(self._updates())
        self.state = opt.groups[0].xp.zeros(GROUPS + len(self.stepped), dtype=np.float64)
        self._give(dry=True)
        opt.held_by = self
        if self.scaler is not None:
            self.scaler.held_by = self

    def queue(self, replicas=None):
        """Inside the capture, after the passes: the step's checks taken (the graph writes their
        flags), then the norm's sums, their sum over the ranks (and HSDP's replicas: a failed check
        anywhere stops every rank), the verdict, the scale's device copies and the update queued.
        Returns fill(): the kernels' tables written once the capture has fixed where the gradients
        live."""
        opt = self.optimizer
        self._checks = flags, checks = opt.verdict.take_pending()
        scales = self.scaler.device_scales() if self.scaler is not None else []
        comms, updates = (opt.comm, replicas), self._updates()
        self._sums, fill = self.kernels.queue(self._tables, self.state, updates, flags, checks, comms, scales)
        return fill

    def checked_sums(self) -> np.ndarray:
        """The per-group sums the capture's check replay computed (one read)."""
        (sums,) = self.optimizer.comm.read([self._sums], "a graph's self-check")
        return np.asarray(sums, dtype=np.float64)

    def arm(self):
        """After the check: the state as the host holds it, no longer dry."""
        self._give(dry=False)

    def _updates(self) -> list:
        """(p, g, m, v, decay segments) of each group the graph steps, as they are now."""
        opt = self.optimizer
        return [
            (g.flat_param(), g.flat_grad(), *(opt.state_at(i)[k] for k in opt.STATE), opt.decayed(i))
            for i, g in ((i, opt.groups[i]) for i in self.stepped)
        ]

    # -- around every replay ----------------------------------------------------------------------
    def launched(self):
        """A replay was queued: the next settle reads its state."""
        self._pending = True

    def settle(self) -> dict | None:
        """Read the last replayed step's state (one host sync), mirror it into the optimizer and the
        scaler, and raise what eager training would have raised, on every rank. Returns the state by
        PLACES' names; None where no replay was queued since the last read."""
        self._refuse_if_stopped()
        if not self._pending:
            return None
        self._pending = False
        (vector,) = self.optimizer.comm.read([self.state], "a graphed step's verdict")
        state = dict(zip(PLACES[:GROUPS], vector[:GROUPS]))
        self._mirror(state)
        stop = STOPS[int(state["stop"])]
        if stop != "none":
            try:
                self._stop(stop, state)
            except Exception as exc:
                self._stopped = f"{type(exc).__name__}: {exc}"
                raise
        return state

    def sync_host(self):
        """Before a replay: what the host changed since the device was last given its state or left
        it (the lr, a setting, counts or a scale restored) given to the device (one small copy)."""
        if not np.array_equal(self._view(), self._seen):
            check_lr(type(self.optimizer).__name__, self.optimizer.lr)
            self._give(dry=False)

    def _give(self, dry: bool):
        """The host's view to the device, the counts rebased on it."""
        view = self._view()
        self._seen = view.copy()
        view[PLACES.index("dry")] = float(dry)
        backend.write_into(self.state, view)
        opt = self.optimizer
        self._base = (opt.step_count, [opt.group_step(i) for i in self.stepped])

    def _view(self) -> np.ndarray:
        """The state as the host holds it: its counts, scale and settings (nothing taken since)."""
        opt, scaler = self.optimizer, self.scaler
        values = dict(
            lr=opt.lr,
            skipped=self._skipped_now(),
            max_norm=self.max_norm or 0.0,
            beta1=opt.beta1,
            beta2=opt.beta2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            **{"raise": float(opt.nonfinite == "raise")},
            **_scaler_values(scaler),
        )
        state = np.zeros(GROUPS + len(self.stepped), dtype=np.float64)
        for name, value in values.items():
            state[PLACES.index(name)] = value
        state[GROUPS:] = [opt.group_step(i) for i in self.stepped]
        return state

    def _skipped_now(self) -> int:
        return (self.scaler or self.optimizer).skipped_steps

    def _mirror(self, state: dict):
        """The host's counts as the device left them (what checkpoints and reports read)."""
        opt, taken = self.optimizer, int(state["taken"])
        opt.step_count = self._base[0] + taken
        for i, steps in zip(self.stepped, self._base[1]):
            opt.set_group_step(i, steps + taken)
        if self.scaler is not None:
            self.scaler.take(state)
        else:
            opt.skipped_steps = int(state["skipped"])
        said = int(self._seen[PLACES.index("skipped")])  # the skips the host knew of before this read
        for _ in range(int(state["skipped"]) - said):
            job_warning(opt.comm, log, "skipped a step: gradient norm %s (read a step late)", state["norm"])
        for name in ("scale", "good", "skips_in_a_row", "skipped"):  # what the device moved, as it is
            self._seen[PLACES.index(name)] = state[name]
        self._seen[GROUPS:] = np.add(self._base[1], taken)

    def _refuse_if_stopped(self):
        """After a step that stopped the job (its error raised once), every call: the graph would
        update on from parameters the stop meant to keep."""
        if self._stopped is not None:
            raise RuntimeError(
                f"GraphedPasses: this job stopped at an earlier step ({self._stopped}); nothing was updated "
                "since. Resume from the last checkpoint"
            )

    def _stop(self, stop: str, state: dict):
        """Raise, on every rank, the error of the step that stopped (its update did not run)."""
        if stop == "refused":
            verdict, (flags, checks) = self.optimizer.verdict, self._checks
            read = self.optimizer.comm.read(verdict_arrays(flags, checks), "a graphed step's checks")
            verdict.note(flags, checks, read)
            verdict.raise_found()
            raise RuntimeError("a graphed step's check failed on another rank: every rank stops here")
        if stop == "nonfinite":
            step = self.optimizer.step_count + 1
            name = type(self.optimizer).__name__
            raise nonfinite_error(name, state["norm"], step, "; the graph's update did not run")
        in_a_row, in_all = int(state["skips_in_a_row"]) + 1, int(state["skipped"]) + 1
        raise overflow_error(state["scale"], in_a_row, in_all)


def _scaler_values(scaler) -> dict:
    """The state's places a LossScaler fills (a scale of 1 that never moves without one)."""
    if scaler is None:
        return dict(scale=1.0, growth=1, min_scale=1.0, max_skips=1)
    return dict(
        scale=scaler.scale_value,
        good=scaler.good_steps,
        skips_in_a_row=scaler.skips_in_a_row,
        growth=scaler.growth_interval,
        min_scale=scaler.min_scale,
        max_skips=scaler.max_skips_in_a_row,
        scaled=1.0,
    )


__all__ = ["PLACES", "STOPS", "DeviceStep"]
