"""fully_shard(): bind Units to Modules, and the per-unit forward/backward schedule.

Each unit module's forward runs as: unshard (Allgather) -> bind parameter views -> forward (its
nodes recorded under the unit's autodiff scope) -> reshard (free). Backward, through the scope:
pre_backward gathers again and points every parameter's .grad at a view of one flat full_grad;
the VJPs accumulate into it; post_backward reduce-scatters it into the grad shard and frees both.
The rest of the model is the root unit, whose scope encloses everything, so its post_backward is
the end of backward.

Overlap (as FSDP2): while unit k computes, the gathers of the next `prefetch` units are in flight
(forward: the order units ran in the previous forward, registration order at first; backward: the
reverse of this forward's order), and each unit's reduce-scatter runs while the next unit's
backward computes. Every rank issues the same collectives in the same order (docs/design.md, invariant 5):
the schedule depends only on the model's structure, never on data.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from contextlib import nullcontext

from . import ops
from .accounting import MemoryLedger
from .autodiff import grad_enabled, scope
from .comm import CollectiveError, Comm
from .layers import Module
from .unit import BufferPool, Unit, state_dict


class UnitState:
    """The FSDP state of one unit: its Params, and the transitions around forward and backward."""

    def __init__(self, unit: Unit | None, params, group: FSDPGroup, reshard_after_forward: bool):
        self.unit, self.params, self.group = unit, params, group  # params: [(name in unit, Param)]
        self.reshard_after_forward = reshard_after_forward

    def _bind(self, views):
        for name, p in self.params:
            p.data = views[name]

    def _unbind(self):
        for _, p in self.params:
            p.data = None

    # -- forward ----------------------------------------------------------------------------------
    def run_forward(self, forward, *args, **kwargs):
        """Module._forward_wrapper: the unit is unsharded while its forward runs."""
        group, is_root = self.group, self is self.group.root
        if is_root:
            group.check_inputs(args, kwargs)
            group.recording = []
        if self.unit is not None:
            self._bind(self.unit.unshard("forward"))
        group.prefetch(self, "forward")
        global_mean = ops.mean_over_ranks(group.count_share) if is_root else nullcontext()
        try:
            with global_mean:
                if not grad_enabled():
                    return forward(*args, **kwargs)
                group.pending.add(self)
                with scope(self):
                    return forward(*args, **kwargs)
        finally:
            if not is_root:
                group.recording.append(self)
            if self.unit is not None:
                self._unbind()
                if self.reshard_after_forward or not grad_enabled():
                    self.unit.reshard()
            if is_root:
                group.end_forward()

    # -- backward (called by the autodiff engine through the scope) -------------------------------
    def pre_backward(self):
        if self.unit is not None:
            self._bind(self.unit.unshard("backward"))
            grads = self.unit.zero_full_grad()
            for name, p in self.params:
                p.grad = grads[name]  # VJPs accumulate in place into the flat full_grad
        self.group.prefetch(self, "backward")

    def post_backward(self):
        group = self.group
        if self is group.root:
            group.finalize_pending()
        group.pending.discard(self)
        if self.unit is not None:
            for _, p in self.params:
                p.grad = None
            self._unbind()
            self.unit.start_reduce_grad(phase="backward")
            self.unit.reshard()
            group.reducing.append(self.unit)
        while len(group.reducing) > (0 if self is group.root else group.max_reducing):
            group.reducing.popleft().finish_reduce_grad()
        if self is group.root:
            group.release_prefetched()
            group.comm.check_schedule()  # every rank issued the same collectives this step


class FSDPGroup:
    """All units of one sharded model: the shared ledger and pool, the root, and the schedule."""

    def __init__(self, comm: Comm, prefetch: int, max_reducing: int = 1):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 (units gathered ahead), got {prefetch}")
        self.comm = comm
        self.model = None  # the sharded model (its check_inputs runs in the root's forward)
        self.ledger = MemoryLedger()
        self.pool = BufferPool()
        self.states: list[UnitState] = []
        self.root: UnitState | None = None
        self.prefetch_depth = prefetch
        self.max_reducing = max_reducing  # reduce-scatters left in flight while backward goes on
        self.pending: set = set()  # units whose forward ran with grad and await post_backward
        self.recording: list = []  # non-root units in the order this forward ran them
        self.forward_order: list = []  # ... as the previous forward ran them (drives prefetch)
        self.backward_order: list = []  # the reverse of the last forward with grad
        self.reducing: deque = deque()  # units whose reduce-scatter is in flight

    @property
    def units(self) -> list[Unit]:
        return [s.unit for s in self.states if s.unit is not None]

    def check_inputs(self, args, kwargs):
        """Refuse bad input and unequal batches on every rank (collective; one tiny allgather).

        Each rank contributes its batch size, whether model.check_inputs found a problem (if any rank
        did, every rank raises with each rank's message) and its schedule position (collectives
        issued and their hash: a rank that ran an extra forward or backward is caught here).
        [Note: gradient averaging] Reduce-scatter then /N averages ranks' gradients with equal weight;
        with unequal batches that is not the gradient of the global mean (docs/design.md, invariant 3),
        so an uneven last batch is an error here rather than a silently wrong update.
        """
        model = self.model
        try:  # a check that fails on one rank must still reach the exchange below
            problem = model.check_inputs(*args, **kwargs)
        except Exception as exc:
            problem = f"check_inputs raised {type(exc).__name__}: {exc}"
        n = next((int(a.shape[0]) for a in args if getattr(a, "ndim", 0) > 0), -1)
        seq, digest = self.comm.schedule.position()  # so forward, too, starts from a checked schedule
        verdicts = self.comm.gather_ints(
            n, int(bool(problem)), seq, digest, phase="forward", op="batch_size_check"
        )
        self.comm.check_positions(verdicts[:, 2:], "at the start of a forward")
        if verdicts[:, 1].any():
            self.comm.raise_if_any(problem and f"{type(model).__name__}: {problem}", "checking the inputs")
        sizes = verdicts[:, 0].tolist()
        if len(set(sizes)) > 1:
            raise CollectiveError(
                f"ranks hold different batch sizes {dict(enumerate(sizes))}: averaging their gradients would "
                "weight samples unequally. Give every rank the same number of samples (drop or pad the "
                "last batch; data.rank_slice splits a global batch evenly)."
            )

    def count_share(self, local: int) -> float:
        """The count this rank's mean-reduced loss divides by: valid targets summed over ranks / N.

        [Note: gradient averaging] (docs/design.md, invariant 3) With it, the mean of the ranks' losses
        and of their gradients (reduce-scatter, then 1/N) is the global batch's mean even when ranks
        hold different numbers of valid (not ignored) targets. Equal counts give exactly the local one.
        """
        counts = self.comm.gather_ints(local, phase="forward", op="valid_target_count")[:, 0]
        return int(counts.sum()) / self.comm.size

    def prefetch(self, state: UnitState, direction: str):
        """Start the gathers of the next `prefetch` units after `state` in this pass's order."""
        if direction == "forward":
            order = self.forward_order or [s for s in self.states if s is not self.root]
        else:
            order = self.backward_order
        if state is self.root:
            ahead = order[: self.prefetch_depth]
        elif state in order:
            i = order.index(state)
            ahead = order[i + 1 : i + 1 + self.prefetch_depth]
        else:
            ahead = []
        for nxt in ahead:
            if nxt.unit is not None:
                nxt.unit.start_unshard(direction)

    def end_forward(self):
        self.forward_order = self.recording
        if grad_enabled():
            self.backward_order = list(reversed(self.recording))
        self.release_prefetched()

    def release_prefetched(self):
        """Reshard units gathered ahead that will not run now (a changed order, or the pass ended)."""
        for s in self.states:
            keep = s in self.pending and not s.reshard_after_forward
            if s is not self.root and s.unit is not None and not keep:
                s.unit.reshard()

    def plan(self) -> dict:
        """Expected bytes per rank: persistent 16 * shard (fp32 AdamW) plus what is gathered at once."""
        units = self.units
        itemsize = units[0].layout.dtype.itemsize
        root = self.root.unit.layout.padded_numel * itemsize if self.root.unit else 0
        others = [u.layout.padded_numel * itemsize for u in units if u is not self.root.unit]
        return {
            "units": len(units),
            "params": sum(u.layout.numel for u in units),
            "persistent": 4 * itemsize * sum(u.numel for u in units),
            "largest_unit": max(others, default=0),
            "root_unit": root,
            "prefetch": self.prefetch_depth,
        }

    def report(self) -> list[dict]:
        """Every rank's memory and communication ledgers (collective: call on all ranks)."""
        memory = {**self.ledger.report(), "pool_bytes": self.pool.nbytes}
        mine = {"rank": self.comm.rank, "memory": memory, "comm": self.comm.ledger.report()}
        return self.comm.allgather_object(mine)

    def finalize_pending(self):
        """End-of-backward sweep: reduce-scatter (zero) grads of units that backward never reached.

        [Note: post-backward always runs] A unit whose forward ran with grad but whose outputs did
        not reach the loss has no node in the graph, so the engine never calls its hooks. Without
        this sweep it would skip its reduce-scatter, and ranks would disagree on the collective
        sequence whenever the skip is data-dependent (docs/design.md, invariant 6).
        """
        for state in [s for s in self.states if s in self.pending and s is not self.root]:
            state.pre_backward()
            state.post_backward()


def _owned_params(module: Module, prefix: str, unit_ids: set) -> list:
    """(dotted name, Param) reachable from `module` without entering another unit's module; each once."""
    found, seen = [], set()

    def walk(mod, mod_prefix):
        for name, child in mod._children():
            full = f"{mod_prefix}.{name}" if mod_prefix else name
            if isinstance(child, Module):
                if id(child) not in unit_ids:
                    walk(child, full)
            elif id(child) not in seen:
                seen.add(id(child))
                found.append((full, child))

    walk(module, prefix)
    return found


def _shared_parameters(owned) -> dict:
    """{parameter name: [units]} for each parameter that more than one unit would own.

    [Note: one unit per parameter] (docs/design.md, invariant 4) A tied weight in two units would be
    gathered, reduced and updated twice; fully_shard refuses it on every rank."""
    owners: dict[int, list[str]] = {}
    for unit_name, params in owned:
        for _, p in params:
            owners.setdefault(id(p), []).append(unit_name)
    return {name: owners[id(p)] for _, params in owned for name, p in params if len(owners[id(p)]) > 1}


def _configuration(model: Module) -> list:
    """Every module's type and public settings (numbers, strings, dataclass configs): what a rank can
    get wrong without changing any shape (heads, dropout rate, eps), so the layout check cannot see it."""
    plain = (int, float, str, bool, type(None))
    found = []
    for path, module in model.named_modules():
        settings = {
            k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
            for k, v in vars(module).items()
            if not k.startswith("_") and (isinstance(v, plain) or dataclasses.is_dataclass(v))
        }
        found.append((path, type(module).__name__, sorted(settings.items())))
    return found


def _configuration_differs(model: Module, comm: Comm) -> str | None:
    """Collective: None when every rank's model has the same configuration, else where it differs."""
    everyone = comm.allgather_object(_configuration(model))
    for rank, theirs in enumerate(everyone[1:], 1):
        for mine, other in zip(everyone[0], theirs):
            if mine != other:
                return (
                    f"the model's configuration differs between ranks: "
                    f"{mine} on rank 0, {other} on rank {rank}"
                )
    return None


def fully_shard(
    model: Module,
    comm: Comm,
    units=(),
    *,
    prefetch: int = 1,
    reshard_after_forward=True,
    reshard_root=False,
    param_dtype=None,
    reduce_dtype=None,
    sync_params: bool = False,
) -> Module:
    """Shard `model` over `comm`: each module in `units` becomes a unit, the rest the root unit.

    After this, every rank holds only its 1/N shard of each unit's parameters; run the model as
    usual (loss = model(x, y); loss.backward()), and build AdamW(model) to step the shards.
    prefetch: units whose gather runs ahead of compute (0 = none; memory grows by one unit each).
    reshard_after_forward: True frees a unit's parameters after its forward and gathers them again
    for backward; False keeps them (2 collectives per step instead of 3, more memory). A bool for
    every unit, or a dict {unit module: bool}. reshard_root: the same for the root unit (FSDP2 keeps
    it, as its parameters are the first needed by backward).
    param_dtype / reduce_dtype: mixed precision. Shards, gradient shards and AdamW state stay in the
    model's dtype (fp32 masters); parameters are gathered and computed in param_dtype (e.g. float16)
    and gradients reduce-scattered in reduce_dtype (default param_dtype). Use LossScaler with float16.
    sync_params: take rank 0's initial values for every rank. By default every rank must build the
    same values (same seed), and the model's configuration must match across ranks: both checked,
    so that no rank trains a different model silently.
    """
    if getattr(model, "_fsdp", None) is not None:
        raise RuntimeError("fully_shard() was already called on this model: call it once, with every unit")
    units = list(units)
    names = {id(m): n for n, m in model.named_modules()}
    unknown = [type(u).__name__ for u in units if id(u) not in names]
    if unknown or any(u is model for u in units):
        raise ValueError(
            f"units must be submodules of the model (got {unknown or ['the model itself']}); "
            "the model is always the root unit"
        )
    if isinstance(reshard_after_forward, dict):
        flags = [bool(reshard_after_forward.get(u, True)) for u in units]
    else:
        flags = [bool(reshard_after_forward)] * len(units)
    unit_ids = {id(u) for u in units}
    owned = [(names[id(u)], _owned_params(u, names[id(u)], unit_ids)) for u in units]
    owned.append(("root", _owned_params(model, "", unit_ids)))

    shared = _shared_parameters(owned)
    error = None
    if shared:
        error = (
            f"parameters shared between units {shared}: tied weights must live in one unit; put the "
            "modules that share them in the same unit (e.g. leave both in the root)"
        )
    differs = _configuration_differs(model, comm)  # collective: every rank, whatever `error` is
    comm.raise_if_any(error or differs, "fully_shard")

    group = FSDPGroup(comm, prefetch)
    group.model = model
    modules = list(units) + [model]
    for module, (unit_name, params), flag in zip(modules, owned, flags + [bool(reshard_root)]):
        unit = None
        if params or module is not model:
            arrays = [(n, p.initial_value()) for n, p in params]  # deferred: made now, one unit at a time
            unit = Unit(
                unit_name, arrays, comm, ledger=group.ledger, pool=group.pool,
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, sync_values=sync_params,
            )  # fmt: skip
        state = UnitState(unit, params, group, flag)
        for n, p in params:
            p.name, p.unit_name = n, unit_name
        group.states.append(state)
        module._forward_wrapper = state.run_forward
    group.root = group.states[-1]
    group.pool.size = max(u.layout.padded_numel for u in group.units)
    for state in group.states:
        state._unbind()  # from here on, parameters exist only as shards
    model._fsdp = group
    return model


def fsdp_group(model) -> FSDPGroup | None:
    return getattr(model, "_fsdp", None)


def full_state_dict(model: Module) -> dict:
    """Host copies of every parameter by name, gathered unit by unit (collective: call on all ranks)."""
    group = fsdp_group(model)
    return dict(model.state_dict()) if group is None else state_dict(group.units)
