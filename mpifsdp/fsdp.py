"""fully_shard(): bind Units to Modules, and the per-unit forward/backward schedule.

Each unit module's forward runs as: unshard (Allgather) -> bind parameter views -> forward (its
nodes recorded under the unit's autodiff scope) -> reshard (free). Backward, through the scope:
pre_backward gathers again and points every parameter's .grad at a view of one flat full_grad;
the VJPs accumulate into it; post_backward reduce-scatters it into the grad shard and frees both.
The rest of the model is the root unit, whose scope encloses everything, so its post_backward is
the end of backward: it first finalizes any unit that ran forward but whose nodes never reached
backward, so every rank issues every reduce-scatter (DESIGN invariant 6).
"""

from __future__ import annotations

from .accounting import MemoryLedger
from .autodiff import grad_enabled, scope
from .backend import to_numpy
from .comm import Comm
from .layers import Module
from .unit import Unit


class UnitState:
    """The FSDP state of one unit: its Params, and the transitions around forward and backward."""

    def __init__(self, unit: Unit | None, params, group: FSDPGroup):
        self.unit, self.params, self.group = unit, params, group  # params: [(name in unit, Param)]

    def _bind(self, views):
        for name, p in self.params:
            p.data = views[name]

    def _unbind(self):
        for _, p in self.params:
            p.data = None

    # -- forward ----------------------------------------------------------------------------------
    def run_forward(self, forward, *args, **kwargs):
        """Module._forward_wrapper: the unit is unsharded exactly while its forward runs."""
        if self.unit is not None:
            self._bind(self.unit.unshard("forward"))
        try:
            if not grad_enabled():
                return forward(*args, **kwargs)
            self.group.pending.add(self)
            with scope(self):
                return forward(*args, **kwargs)
        finally:
            if self.unit is not None:
                self._unbind()
                self.unit.reshard()

    # -- backward (called by the autodiff engine through the scope) -------------------------------
    def pre_backward(self):
        if self.unit is None:
            return
        self._bind(self.unit.unshard("backward"))
        grads = self.unit.zero_full_grad()
        for name, p in self.params:
            p.grad = grads[name]  # VJPs accumulate in place into the flat full_grad

    def post_backward(self):
        if self is self.group.root:
            self.group.finalize_pending(except_root=True)
        self.group.pending.discard(self)
        if self.unit is None:
            return
        for _, p in self.params:
            p.grad = None
        self.unit.reduce_grad(phase="backward")
        self._unbind()
        self.unit.reshard()


class FSDPGroup:
    """All units of one sharded model, their shared memory ledger, and the root."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.ledger = MemoryLedger()
        self.states: list[UnitState] = []
        self.root: UnitState | None = None
        self.pending: set = set()  # units whose forward ran with grad and await post_backward

    @property
    def units(self) -> list[Unit]:
        return [s.unit for s in self.states if s.unit is not None]

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
        }

    def report(self) -> list[dict]:
        """Every rank's memory and communication ledgers (collective: call on all ranks)."""
        mine = {"rank": self.comm.rank, "memory": self.ledger.report(), "comm": self.comm.ledger.report()}
        return self.comm.allgather_object(mine)

    def finalize_pending(self, except_root: bool):
        """End-of-backward sweep: reduce-scatter (zero) grads of units that backward never reached.

        [Note: post-backward always runs] A unit whose forward ran with grad but whose outputs did
        not reach the loss has no node in the graph, so the engine never calls its hooks. Without
        this sweep it would skip its reduce-scatter, and ranks would disagree on the collective
        sequence whenever the skip is data-dependent (DESIGN invariant 6).
        """
        for state in [s for s in self.states if s in self.pending]:
            if except_root and state is self.root:
                continue
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


def fully_shard(model: Module, comm: Comm, units=()) -> Module:
    """Shard `model` over `comm`: each module in `units` becomes a unit, the rest the root unit.

    After this, every rank holds only its 1/N shard of each unit's parameters; run the model as
    usual (loss = model(x, y); loss.backward()), and build AdamW(model) to step the shards.
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
    unit_ids = {id(u) for u in units}
    owned = [(names[id(u)], _owned_params(u, names[id(u)], unit_ids)) for u in units]
    owned.append(("root", _owned_params(model, "", unit_ids)))

    owners: dict[int, list[str]] = {}
    for unit_name, params in owned:
        for _, p in params:
            owners.setdefault(id(p), []).append(unit_name)
    shared = {pname: owners[id(p)] for _, params in owned for pname, p in params if len(owners[id(p)]) > 1}
    error = None
    if shared:
        # [Note: one unit per parameter] a tied weight in two units would be gathered and updated twice.
        error = (
            f"parameters shared between units {shared}: tied weights must live in one unit; put the "
            "modules that share them in the same unit (e.g. leave both in the root)"
        )
    comm.raise_if_any(error, "fully_shard")

    group = FSDPGroup(comm)
    modules = list(units) + [model]
    for module, (unit_name, params) in zip(modules, owned):
        unit = None
        if params or module is not model:
            unit = Unit(unit_name, [(n, p.data) for n, p in params], comm, ledger=group.ledger)
        state = UnitState(unit, params, group)
        for n, p in params:
            p.name, p.unit_name = n, unit_name
        group.states.append(state)
        module._forward_wrapper = state.run_forward
    group.root = group.states[-1]
    for state in group.states:
        state._unbind()  # from here on, parameters exist only as shards
    model._fsdp = group
    return model


def fsdp_group(model) -> FSDPGroup | None:
    return getattr(model, "_fsdp", None)


def full_state_dict(model: Module) -> dict:
    """Host copies of every parameter by name, gathered unit by unit (collective: call on all ranks)."""
    group = fsdp_group(model)
    if group is None:
        return dict(model.state_dict())
    state = {}
    for unit in group.units:
        state.update({n: to_numpy(v).copy() for n, v in unit.gather(unit.shard).items()})
    return state
