"""How fully_shard divides a model: which parameters each unit owns, the per-unit options, and the
checks every rank runs before sharding (tied weights across units, configurations that differ)."""

from __future__ import annotations

import dataclasses

from ..base.checks import is_count
from ..comm.communicator import Comm
from ..nn.module import Module


def owned_params(module: Module, prefix: str, unit_ids: set) -> list:
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


def per_unit(name: str, option, units, default: bool) -> list[bool]:
    """A bool for every unit from a bool or a {unit module: bool} dict. A dict naming a module that
    is not a unit is an error: its setting would be dropped without a word."""
    if isinstance(option, dict):
        unit_ids = {id(u) for u in units}
        strays = [type(m).__name__ for m in option if id(m) not in unit_ids]
        if strays:
            raise ValueError(
                f"fully_shard: {name} names modules that are not units ({strays}): add them to units=, "
                f"or leave them out of {name}"
            )
        return [bool(option.get(u, default)) for u in units]
    return [bool(option)] * len(units)


def holds_units(module: Module, unit_ids: set) -> bool:
    return any(id(m) in unit_ids for _, m in module.named_modules() if m is not module)


def division_error(owned, recomputed, names: dict, unit_ids: set) -> str | None:
    """What is wrong with this division into units, or None: a parameter in two units, or a
    recomputed unit that holds other units."""
    shared = shared_parameters(owned)
    if shared:
        return (
            f"parameters shared between units {shared}: tied weights must live in one unit; put the "
            "modules that share them in the same unit (e.g. leave both in the root)"
        )
    nested = [names[id(u)] for u in recomputed if holds_units(u, unit_ids)]
    if nested:
        return (
            f"units {nested} are recomputed but contain other units: their re-run in backward would "
            "run those units' forward again; recompute the inner units instead"
        )
    return None


def shared_parameters(owned) -> dict:
    """{parameter name: [units]} for each parameter that more than one unit would own.

    [Note: one unit per parameter] (docs/design.md, invariant 4) A tied weight in two units would be
    gathered, reduced and updated twice; fully_shard refuses it on every rank."""
    owners: dict[int, list[str]] = {}
    for unit_name, params in owned:
        for _, p in params:
            owners.setdefault(id(p), []).append(unit_name)
    return {name: owners[id(p)] for _, params in owned for name, p in params if len(owners[id(p)]) > 1}


def configuration(model: Module) -> list:
    """Every module's type and public settings (numbers, strings, dataclass configs), and which
    parameters are frozen: what a rank can get wrong without changing any shape (heads, dropout rate,
    eps, a parameter left trainable), so the layout check cannot see it."""
    plain = (int, float, str, bool, type(None))
    found = [("frozen parameters", sorted(n for n, p in model.named_parameters() if not p.requires_grad))]
    for path, module in model.named_modules():
        settings = {
            k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
            for k, v in vars(module).items()
            if not k.startswith("_") and (isinstance(v, plain) or dataclasses.is_dataclass(v))
        }
        found.append((path, type(module).__name__, sorted(settings.items())))
    return found


def configuration_differs(model: Module, comm: Comm, options: dict | None = None) -> str | None:
    """Collective: None when every rank's model has the same configuration, and fully_shard the same
    `options` (a chunk size, a dtype, prefetch), else where it differs. Compared as written (repr): a
    NaN setting is the same NaN on every rank, and the check that refuses it names it."""
    everyone = comm.allgather_object((configuration(model), options or {}))
    for rank, (theirs, their_options) in enumerate(everyone[1:], 1):
        for key, value in everyone[0][1].items():
            if repr(value) != repr(their_options.get(key)):
                values = {r: o.get(key) for r, (_, o) in enumerate(everyone)}
                return f"fully_shard's {key} differs between ranks: {values}; give every rank the same"
        for mine, other in zip(everyone[0][0], theirs):
            if repr(mine) != repr(other):
                return (
                    f"the model's configuration differs between ranks: "
                    f"{mine} on rank 0, {other} on rank {rank}"
                )
    return None


def shard_groups(comm: Comm, shard_size) -> tuple[Comm, Comm | None]:
    """(this rank's shard group, its replicas across groups) for fully_shard(shard_size=...).
    Collective over comm. Plain FSDP (None, or the world's size) is (comm, None)."""
    if shard_size == "node":
        sizes = comm.allgather_object((comm.node_id, comm.node_size))
        if len({size for _, size in sizes}) > 1:
            raise ValueError(
                f"shard_size='node' needs nodes of equal size, got (first rank, size) {sorted(set(sizes))}"
            )
        group = comm.split(comm.node_id)
    elif shard_size is None or shard_size == comm.size:
        return comm, None
    elif is_count(shard_size, 1) and comm.size % shard_size == 0:
        group = comm.split(comm.rank // int(shard_size))
    else:
        raise ValueError(
            f"shard_size={shard_size!r}: give an int that divides the {comm.size} ranks, 'node', or None"
        )
    if group.size == comm.size:
        return group, None
    return group, comm.split(group.rank)
