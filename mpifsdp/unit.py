"""Unit: one flat-sharded parameter group. The framework-agnostic core of mpifsdp.

A Unit takes named arrays, lays them end to end (FlatLayout) and keeps only this rank's slice:
`shard` and `grad_shard` persist; `full` and `full_grad` exist only while the unit is unsharded.
Nothing here knows about autodiff, so a NumPy/CuPy code with hand-written gradients can use it:

    unit = Unit("model", {"w": w0, "b": b0}, comm)
    with unit.unsharded() as p:                   # Allgather -> views of the full parameters
        grads = my_gradients(p["w"], p["b"], my_batch)
    unit.reduce_grad(grads)                        # Reduce_scatter (mean over ranks) -> grad_shard
    opt = AdamW([unit], lr=1e-2); opt.step()       # local update of this rank's shard
"""

from __future__ import annotations

import contextlib

from .accounting import MemoryLedger
from .backend import array_module_of
from .flat import FlatLayout


class Unit:
    def __init__(self, name: str, named_arrays, comm, *, dtype=None, ledger: MemoryLedger | None = None):
        named_arrays = list(named_arrays.items() if isinstance(named_arrays, dict) else named_arrays)
        self.name, self.comm = name, comm
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.layout = self._agreed_layout(named_arrays, dtype)
        self.xp = array_module_of(named_arrays[0][1])  # the layout check refused empty units
        n = self.layout.shard_numel
        # [Note: padding] shard positions past the last tensor start at zero, and every update keeps
        # them there (the padded gradient is zero, so AdamW moves nothing): DESIGN invariant 2.
        self.shard = self.xp.zeros(n, dtype=self.layout.dtype)
        arrays = dict(named_arrays)
        for tensor, t0, t1, s0 in self.layout.pieces_in_shard(comm.rank):
            self.shard[s0 : s0 + t1 - t0] = self.xp.asarray(arrays[tensor]).reshape(-1)[t0:t1]
        self.grad_shard = self.xp.zeros(n, dtype=self.layout.dtype)
        self.has_grad = False
        self.ledger.alloc("param_shard", self.shard.nbytes)
        self.ledger.alloc("grad_shard", self.grad_shard.nbytes)
        self.full = None
        self.full_grad = None

    def _agreed_layout(self, named_arrays, dtype) -> FlatLayout:
        """Build the layout and check, collectively, that every rank built the same one."""
        layout, error = None, None
        try:
            layout = FlatLayout.of(named_arrays, self.comm.size, dtype)
            if layout.numel == 0:
                error = "has no parameters: give it at least one array, or leave it out"
        except (TypeError, ValueError) as exc:
            error = str(exc)
        fingerprints = self.comm.allgather_object(None if layout is None else layout.fingerprint())
        if error is None and len(set(fingerprints)) > 1:
            error = (
                f"layout differs between ranks ({layout.describe()} here, fingerprints {fingerprints}): "
                "build the model identically on every rank (same config, same seed)"
            )
        self.comm.raise_if_any(error and f"unit {self.name!r} {error}", f"creating unit {self.name!r}")
        return layout

    def __repr__(self):
        return f"Unit({self.name!r}, {self.layout.describe()}, {self.state})"

    @property
    def state(self) -> str:
        return "sharded" if self.full is None else "unsharded"

    # -- parameters ---------------------------------------------------------------------------------
    def unshard(self, phase: str = "forward") -> dict:
        """Allgather the full parameters (idempotent); returns name -> view into `full`."""
        if self.full is None:
            self.full = self.xp.empty(self.layout.padded_numel, dtype=self.layout.dtype)
            self.ledger.alloc("gathered_params", self.full.nbytes)
            self.comm.all_gather(self.shard, self.full, unit=self.name, phase=phase)
        return self.layout.views(self.full)

    def reshard(self):
        """Drop the full parameters (idempotent). Views handed out earlier must not be used after."""
        if self.full is not None:
            self.ledger.free("gathered_params", self.full.nbytes)
            self.full = None

    @contextlib.contextmanager
    def unsharded(self, phase: str = "other"):
        """`with unit.unsharded() as params:` full parameters inside, shard only after."""
        try:
            yield self.unshard(phase)
        finally:
            self.reshard()

    # -- gradients ----------------------------------------------------------------------------------
    def zero_full_grad(self) -> dict:
        """Allocate a zeroed flat `full_grad` (idempotent); returns name -> view to accumulate into."""
        if self.full_grad is None:
            self.full_grad = self.xp.zeros(self.layout.padded_numel, dtype=self.layout.dtype)
            self.ledger.alloc("gathered_grads", self.full_grad.nbytes)
        return self.layout.views(self.full_grad)

    def reduce_grad(self, grads: dict | None = None, phase: str = "backward"):
        """Reduce_scatter `full_grad` (or the given name -> array grads) and add the mean to grad_shard.

        [Note: gradient averaging] Reduce-scatter sums over ranks; dividing by N gives the gradient
        of the global-batch mean when every rank holds an equal share of the batch (invariant 3).
        """
        if grads is not None:
            views = self.zero_full_grad()
            missing = set(self.layout.names) - set(grads)
            if missing:
                raise KeyError(f"unit {self.name!r}: reduce_grad is missing gradients for {sorted(missing)}")
            for name, g in grads.items():
                if name not in views:
                    raise KeyError(f"unit {self.name!r} has no tensor {name!r}")
                if tuple(g.shape) != views[name].shape:
                    raise ValueError(
                        f"unit {self.name!r}: gradient {name!r} has shape {tuple(g.shape)}, "
                        f"expected {views[name].shape}"
                    )
                views[name][...] = g
        elif self.full_grad is None:
            raise RuntimeError(
                f"unit {self.name!r}: reduce_grad() without gradients: pass them or zero_full_grad()"
            )
        mean = self.xp.empty_like(self.grad_shard)
        self.ledger.alloc("gathered_grads", mean.nbytes)
        self.comm.reduce_scatter(self.full_grad, mean, unit=self.name, phase=phase)
        mean /= self.comm.size
        self.grad_shard += mean
        self.has_grad = True
        self.ledger.free("gathered_grads", mean.nbytes + self.full_grad.nbytes)
        self.full_grad = None

    # -- the flat-group protocol of optim.AdamW ---------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layout.shard_numel

    @property
    def decay_segments(self):
        return self.layout.decay_segments(self.comm.rank)

    def flat_param(self):
        return self.shard

    def flat_grad(self):
        return self.grad_shard if self.has_grad else None

    def zero_grad(self):
        self.grad_shard[...] = 0
        self.has_grad = False

    # -- consolidation (tests, export) ------------------------------------------------------------
    def gather(self, shard_like) -> dict:
        """Full name -> array of any shard-shaped vector (parameters, grads, moments): a new buffer."""
        full = self.xp.empty(self.layout.padded_numel, dtype=shard_like.dtype)
        self.comm.all_gather(shard_like, full, unit=self.name, phase="other")
        return self.layout.views(full)
