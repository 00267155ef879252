"""fully_shard(): turn a Module into units, each with its UnitLifecycle, under one ShardedModel.

Each unit module's forward then runs inside its UnitLifecycle (lifecycle.py); the model's forward
inside the ShardedModel (model.py), the outermost scope of every step. Parameters no unit module
owns form the root unit. Also the functions that take a sharded model: sharded_model, no_sync,
report, full_state_dict.
"""

from __future__ import annotations

from ..comm.communicator import Comm
from ..nn.module import Module, initial_value
from ..shard.unit import Unit, gathered_params
from .lifecycle import UnitLifecycle
from .model import ShardedModel
from .partition import configuration_differs, division_error, owned_params, per_unit, shard_groups
from .policy import MixedPrecision, offload_policy, resolved


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
    recompute=False,
    shard_size=None,
    deterministic=False,
    chunk_size: int = 1,
    chunk_threads: int = 1,
    mixed_precision: MixedPrecision | None = None,
    offload=None,
    offload_dir=None,
) -> Module:
    """Shard `model` over `comm`: each module in `units` becomes a unit, the rest the root unit.

    After this, every rank holds only its 1/N shard of each unit's parameters; run the model as
    usual (loss = model(x, y); loss.backward()), and build AdamW(model) to step the shards.
    prefetch: units whose gather runs ahead of compute (0 = none; memory grows by one unit each).
    reshard_after_forward: True frees a unit's parameters after its forward and gathers them again
    for backward; False keeps them (2 collectives per step instead of 3, more memory). A bool for
    every unit, or a dict {unit module: bool}. reshard_root: the same for the root unit (FSDP2 keeps
    it, as its parameters are the first needed by backward).
    param_dtype / reduce_dtype (or mixed_precision=MixedPrecision(param_dtype, reduce_dtype)): mixed
    precision. Shards, gradient shards and AdamW state stay in the model's dtype (fp32 masters);
    parameters are gathered and computed in param_dtype (e.g. float16) and gradients reduce-scattered in
    reduce_dtype (default param_dtype). Use LossScaler with float16 (bfloat16, on a GPU, has float32's
    range: no scaler needed).
    sync_params: take rank 0's initial values for every rank. By default every rank must build the
    same values (same seed), and the model's configuration must match across ranks: both checked,
    so that no rank trains a different model silently.
    recompute: activation checkpointing, True for every unit or {unit module: bool}: a recomputed
    unit's forward keeps only its input, and its backward runs the forward again (with the same
    dropout masks) before the VJPs; its parameters are gathered for backward anyway, so no extra
    gather. Activations held drop to every unit's input plus one unit's activations during backward.
    shard_size: hybrid sharding (HSDP). None shards over every rank; an int S (dividing the world
    size) or "node" (the ranks of one node) shards inside groups of S consecutive ranks and
    replicates across the groups: gathers and reduce-scatters stay inside a group (fast links), and
    each gradient shard is all-reduced across the groups (1/S of the model per rank crosses them).
    deterministic (True, or Deterministic(chunk_size, chunk_threads)): the same bits at any world
    size (docs/determinism.md): train through
    `sharded_model(model).chunks(x, y)`, chunks of `chunk_size` samples whose gradients are summed
    exactly, as integers; N must divide the number of chunks of the global batch. chunk_threads:
    the BLAS threads a chunk's GEMMs run on, whatever the rank's own setting (OpenBLAS's bits depend
    on the count): with chunk_size, what fixes the bits; more than 1 gives a rank of many cores (one
    rank a node) its GEMMs' parallelism back.
    offload="disk" with offload_dir=PATH (or offload=Offload("disk", PATH)): the optimizer's states
    (AdamW's moments) in files under PATH, this rank's own, one unit's in memory at a time at each
    step, gone with the optimizer: a model whose states exceed memory trains, to the same bits (a
    CPU model).
    """
    if sharded_model(model) is not None:
        raise RuntimeError("fully_shard() was already called on this model: call it once, with every unit")
    param_dtype, reduce_dtype, deterministic, chunk_size, chunk_threads = resolved(
        mixed_precision, deterministic, param_dtype, reduce_dtype, chunk_size, chunk_threads
    )
    offload = offload_policy(offload, offload_dir, comm.device)
    names = ("prefetch", "reshard_root", "sync_params", "shard_size", "chunk_size", "chunk_threads")
    given = dict(zip(names, (prefetch, reshard_root, sync_params, shard_size, chunk_size, chunk_threads)))
    given.update(
        param_dtype=str(param_dtype),
        reduce_dtype=str(reduce_dtype),
        deterministic=bool(deterministic),
        offload=offload.kind if offload else None,  # the directory may differ by node: not compared
    )
    units, flags, recomputed, owned = _division(model, comm, units, reshard_after_forward, recompute, given)

    shard_comm, replicas = shard_groups(comm, shard_size)
    if chunk_threads != 1 and not deterministic:
        raise ValueError(f"chunk_threads={chunk_threads!r} is deterministic mode's: pass deterministic=True")
    chunks = (chunk_size, chunk_threads) if deterministic else (None, 1)
    sharded = ShardedModel(model, comm, prefetch, levels=(shard_comm, replicas), chunks=chunks)
    options = dict(
        ledger=sharded.ledger,
        pool=sharded.pool,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        sync_values=sync_params,
        replicas=replicas,
        deterministic=bool(deterministic),
    )
    settings = zip(flags + [bool(reshard_root)], recomputed + [False])
    for module, (unit_name, params), (flag, recomputes) in zip([*units, model], owned, settings):
        if module is model and not params:
            continue  # no root unit: every parameter lives in a unit module
        lifecycle = _lifecycle(sharded, unit_name, params, flag, recomputes, shard_comm, options)
        sharded.add(lifecycle, root=module is model)
        if module is not model:
            module._forward_wrapper = lifecycle.run_forward
    model._forward_wrapper = sharded.run_model
    _release(sharded, offload)
    model._sharded = sharded
    return model


def _release(sharded, offload):
    """From here on, parameters exist only as shards; each unit says where an optimizer of it keeps
    its states (offload), with the job's Comm (its files are named by rank)."""
    for lifecycle in sharded.lifecycles:
        lifecycle.release()
    for unit in sharded.units:
        unit.offload = (offload, sharded.comm) if offload else None


def _division(model: Module, comm: Comm, units, reshard_after_forward, recompute, given: dict):
    """(unit modules, reshard flags, recompute flags, each unit's (name, parameters) with the root's
    last), refused on every rank where the division is wrong or where ranks differ in the model's
    configuration or in fully_shard's options `given` (a chunk size, a dtype). Collective."""
    units = _unit_modules(model, units)
    flags = per_unit("reshard_after_forward", reshard_after_forward, units, default=True)
    recomputed = per_unit("recompute", recompute, units, default=False)
    names = {id(m): n for n, m in model.named_modules()}
    unit_ids = {id(u) for u in units}
    owned = [(names[id(u)], owned_params(u, names[id(u)], unit_ids)) for u in units]
    owned.append(("root", owned_params(model, "", unit_ids)))
    error = division_error(owned, [u for u, on in zip(units, recomputed) if on], names, unit_ids)
    options = {**given, "reshard_after_forward": flags, "recompute": recomputed}
    differs = configuration_differs(model, comm, options)  # collective: every rank, whatever `error` is
    comm.raise_if_any(error or differs, "fully_shard")
    return units, flags, recomputed, owned


def _unit_modules(model: Module, units) -> list:
    units = list(units)
    names = {id(m): n for n, m in model.named_modules()}
    unknown = [type(u).__name__ for u in units if id(u) not in names]
    if unknown or any(u is model for u in units):
        raise ValueError(
            f"units must be submodules of the model (got {unknown or ['the model itself']}); "
            "the model is always the root unit"
        )
    twice = sorted({names[id(u)] for u in units if sum(v is u for v in units) > 1})
    if twice:
        raise ValueError(f"units lists {twice} more than once: give each unit module once")
    return units


def _lifecycle(sharded, unit_name, params, reshard_after_forward, recomputes, shard_comm, options):
    """One unit module's UnitLifecycle: its trainable parameters as one Unit and its frozen ones as
    another beside it (a flat vector is reduced and stepped whole), or all frozen as one."""

    def make_unit(name, part, trainable):
        arrays = [(n, initial_value(p)) for n, p in part]  # deferred: made now, one unit at a time
        return Unit(name, arrays, shard_comm, trainable=trainable, **options), part

    trainable = [(n, p) for n, p in params if p.requires_grad]
    frozen = [(n, p) for n, p in params if not p.requires_grad]
    main = make_unit(unit_name, trainable or frozen, bool(trainable))
    beside = make_unit(f"{unit_name}:frozen", frozen, False) if trainable and frozen else None
    return UnitLifecycle(*main, sharded, reshard_after_forward, recomputes, frozen=beside)


def sharded_model(model) -> ShardedModel | None:
    """The ShardedModel of a model fully_shard() was called on (its units, ledgers, plan), else None."""
    return model._sharded if isinstance(model, Module) else None


def no_sync(model):
    """`with mpifsdp.no_sync(model):` backward keeps full gradients unreduced (gradient accumulation
    with one reduce-scatter per unit at the end: run the last micro-batch's backward outside)."""
    return _require_sharded_model(model, "no_sync").no_sync()


def _require_sharded_model(model, what: str) -> ShardedModel:
    sharded = sharded_model(model)
    if sharded is None:
        raise ValueError(f"{what}() needs a model fully_shard() was called on, got a {type(model).__name__}")
    return sharded


def report(model) -> list[dict]:
    """Every rank's memory and communication ledgers of a sharded model (collective: all ranks call it)."""
    return _require_sharded_model(model, "report").report()


def full_state_dict(target) -> dict:
    """Host copies of every parameter by name, gathered unit by unit (collective: call on all ranks),
    of a model (sharded or not), a Unit, or a list of Units: the one name for a whole state."""
    if isinstance(target, Unit):
        target = [target]
    if isinstance(target, (list, tuple)) and all(isinstance(u, Unit) for u in target):
        return gathered_params(target)
    if isinstance(target, Module):
        sharded = sharded_model(target)
        return dict(target.state_dict()) if sharded is None else gathered_params(sharded.units)
    raise TypeError(
        f"full_state_dict takes a Module, a Unit or a list of Units, not a {type(target).__name__}"
    )
