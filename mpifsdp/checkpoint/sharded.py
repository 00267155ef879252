"""Sharded checkpoints that load at any world size, crash-safe (safetensors files: consolidated.py).

Format (docs/checkpoint.md): a directory with `manifest.json` and one `rank-NNNNN.bin` per saving rank.
Each rank file holds, for every unit and for each of param / exp_avg / exp_avg_sq, that rank's slice
[start, stop) of the unit's *unpadded* flat vector, as raw little-endian bytes, each with a SHA-256.
The manifest records the layout of every unit and where each slice lives, so a job of any size finds
the byte ranges it needs without conversion: rank r of M reads only the slices that overlap its own
shard. Saving writes into `<dir>.tmp-<id>`, fsyncs every file, writes the manifest last, and renames
the directory into place only after every rank has finished: a checkpoint either exists whole or not.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..base.backend import array_module_of, to_numpy
from ..base.checks import is_count, plain_json
from ..base.logs import job_warning
from ..fsdp.build import sharded_model
from ..shard.unit import Unit
from . import lock, publish
from .manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    ChangedWhileRead,
    CheckpointError,
    SettingsDiffer,
    flat_range,
    manifest_digest,
    read_manifest,
    read_slices,
    slice_digest,
    unit_record,
)
from .publish import STAGING

log = logging.getLogger(__name__)

STEP = re.compile(r"step-(\d+)")  # the checkpoints save_step writes (and prunes, and load_latest reads)

if sys.byteorder != "little":  # pragma: no cover - files are little-endian, arrays are written as-is
    raise ImportError("mpifsdp checkpoints are written from little-endian machines only")


@dataclass
class ShardedUnits:
    """What checkpoints need of a sharded model, or of a user's own list of Units.

    `comm` runs the agreement (every rank); `shard` is the ranks one copy of the units is sharded
    over (the same Comm, or with HSDP this rank's group): its rank and size place a rank's slices.
    Only the first group `writes` (every group holds the same values)."""

    units: list
    comm: object
    ledger: object
    shard: object
    writes: bool = True


def sharded_units(target) -> ShardedUnits | None:
    """The units of a fully_shard-ed model or of a list of Units (one Comm); None for anything else.
    Refused on a Comm that stands in for its peers (comm/phantom.py): a checkpoint of one rank alone
    would lack the others' files, and a loaded one would leave the peers' slices stale."""
    found = _units_of(target)
    if found is not None and found.comm.stands_in:
        raise CheckpointError(
            f"{found.comm!r} runs one rank of its job alone, its peers stood in for: there are no peers' "
            "shards to write or ranks to read with; checkpoint a job of real ranks (Comm())"
        )
    return found


def _units_of(target) -> ShardedUnits | None:
    model = sharded_model(target)
    if model is not None:
        first_group = model.replicas is None or model.replicas.rank == 0
        return ShardedUnits(model.units, model.comm, model.ledger, model.shard_comm, first_group)
    if isinstance(target, (list, tuple)) and target and all(isinstance(u, Unit) for u in target):
        if len({id(u.comm) for u in target}) > 1 or any(u.replicas is not None for u in target):
            raise CheckpointError(
                "the units are sharded over different Comms, or replicated (HSDP): checkpoint a model "
                "fully_shard built, or each set of units apart"
            )
        return ShardedUnits(list(target), target[0].comm, target[0].ledger, target[0].comm)
    return None


def require_sharded_units(target) -> ShardedUnits:
    found = sharded_units(target)
    if found is None:
        raise CheckpointError(
            "checkpoints hold a sharded model (call fully_shard(model, Comm()) first; N = 1 works too) "
            f"or a list of Units, not a {type(target).__name__}"
        )
    return found


def collective(comm, action, what: str, root: int | None = None):
    """Run `action()` on every rank (or on `root` only); if it failed anywhere, raise CheckpointError
    on every rank naming each rank's error (a rank failing alone would leave the others waiting)."""
    catch = (CheckpointError, OSError, ValueError)
    return comm.run_everywhere(action, what, catch=catch, error_type=CheckpointError, root=root)


# -- save -------------------------------------------------------------------------------------------


def save(directory, model, optimizer=None, extra: dict | None = None) -> Path:
    """Write a checkpoint of `model` (and `optimizer`) to `directory`, atomically. Collective.

    Every rank writes only its own slices; `extra` (JSON: step, data position, RNG seeds; NumPy
    scalars become Python numbers, anything else JSON cannot hold fails before a byte is written)
    goes into the manifest. An existing `directory` is replaced only once the new one is complete. A
    failed save (disk full, no permission, ...) raises CheckpointError on every rank and leaves
    nothing behind but what was there before.
    """
    sharded = require_sharded_units(model)
    comm = sharded.comm
    final = Path(directory)
    extra = collective(comm, lambda: plain_json("extra", extra or {}, CheckpointError), f"saving to {final}")
    collective(comm, lambda: _claim(final), f"saving to {final}", root=0)
    staging = collective(
        comm, lambda: publish.staging_dir(final, comm), f"creating a directory next to {final}"
    )
    try:
        state = _optimizer_state(optimizer, sharded)
        write = lambda: _write_rank_file(staging, sharded, state) if sharded.writes else None  # noqa: E731
        record = collective(comm, write, f"writing {staging}")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": sharded.shard.size,  # the ranks that wrote a file: one copy of the model
            "units": [unit_record(u) for u in sharded.units],
            # every rank's file is on disk (agreed above)
            "files": [r for r in comm.allgather_object(record) if r is not None],
            "optimizer": None if optimizer is None else optimizer.summary(),
            # a Dropout's position in its masks (every rank's is the same): resumed, the run draws on
            "random_state": model.random_state() if hasattr(model, "random_state") else {},
            # what the weights compute with (heads, eps, activation): a load into other settings is refused
            "settings": model.settings(of_the_weights=True) if hasattr(model, "settings") else {},
            "extra": extra,
        }

        def complete():
            publish.write_manifest(staging, manifest)
            publish.move_into_place(staging, final)

        collective(comm, complete, f"publishing {final}", root=0)
    except CheckpointError:
        collective(comm, lambda: publish.remove_ours(staging), "cleaning up", root=0)
        raise
    return final


def _claim(final: Path):
    """Rank 0: hold the writer lock of `final` (or of the root save_step holds), then check `final`;
    a destination refused leaves no lock it took."""
    own = None if lock.holds(lock.root_lock(final.parent)) else lock.directory_lock(final)
    new = own is not None and not lock.holds(own)
    if own is not None:
        lock.hold(own)
    try:
        publish.prepare(final)
    except (CheckpointError, OSError):
        if new:
            lock.release(own)
        raise


def _optimizer_state(optimizer, sharded) -> dict:
    """id(unit) -> {kind: array} of the optimizer state allocated so far (a unit never stepped has none)."""
    if optimizer is None:
        return {}
    units = {id(u) for u in sharded.units}
    if optimizer.groups and not set(map(id, optimizer.groups)) <= units:
        raise CheckpointError(
            "the optimizer does not step this model's units: build it after fully_shard (AdamW(model))"
        )
    states = {id(target): optimizer.state_of(target) for target in optimizer.groups}
    return {key: state for key, state in states.items() if state}


def _write_rank_file(tmp: Path, sharded, state: dict) -> dict:
    comm = sharded.shard
    name = f"rank-{comm.rank:05d}.bin"
    segments, offset = [], 0
    with open(tmp / name, "wb") as f:
        for index, unit in enumerate(sharded.units):
            start, stop = flat_range(unit, comm.rank, comm.size)
            arrays = {"param": unit.shard, **state.get(id(unit), {})}
            for kind, array in arrays.items():
                data = np.ascontiguousarray(to_numpy(array[: stop - start]))  # no copy on the CPU
                f.write(data)
                segment = {"unit": index, "kind": kind, "start": start, "stop": stop, "offset": offset}
                segments.append({**segment, "sha256": slice_digest(segment, data)})
                offset += data.nbytes
        f.flush()
        os.fsync(f.fileno())
    return {"name": name, "bytes": offset, "segments": segments}


# -- find -----------------------------------------------------------------------------------------


def checkpoints(root) -> list[Path]:
    """The complete `step-N` checkpoints under `root` (written by save_step), newest step first.

    Other directories (a user's `best`, a save in progress, a copy being replaced) are never listed,
    so neither load_latest nor save_step's pruning ever touches them."""
    root = Path(root)
    found = [
        p
        for p in (root.iterdir() if root.is_dir() else [])
        if STEP.fullmatch(p.name) and publish.is_real_dir(p) and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda p: int(STEP.fullmatch(p.name)[1]), reverse=True)


# -- load -------------------------------------------------------------------------------------------


def load(directory, model, optimizer=None) -> dict:
    """Load a checkpoint saved at any world size into the sharded `model` (and `optimizer`). Collective.

    Each rank reads only the slices that overlap its shard, checks their checksums, and copies them in:
    parameters and AdamW moments come back bit-identical. Returns the checkpoint's `extra`.
    A missing, truncated or corrupted file raises CheckpointError, naming the file, on every rank.
    Reading changes nothing on disk (publish.locate): another job may be writing there.
    """
    return _load(Path(directory), model, optimizer)[1]


def _load(directory: Path, model, optimizer) -> tuple[Path, dict]:
    """load(), and where the checkpoint was read."""
    sharded = require_sharded_units(model)
    return read_located(sharded.comm, directory, lambda where: _load_from(where, sharded, model, optimizer))


def _load_from(directory: Path, sharded, model, optimizer) -> dict:
    manifest = agreed_manifest(sharded.comm, directory, model)
    collective(sharded.comm, lambda: _check_fits(manifest, sharded, optimizer), f"loading {directory}")
    filled(sharded.comm, directory, manifest, lambda: _fill(directory, manifest, sharded, optimizer))
    if manifest.get("random_state") and hasattr(model, "load_random_state"):
        collective(
            sharded.comm, lambda: model.load_random_state(manifest["random_state"]), f"loading {directory}"
        )
    if optimizer is not None:  # saved without one: it starts over, not from moments of other params
        optimizer.restore(manifest["optimizer"] or {"step": 0})
        if manifest["optimizer"] is None:
            name = type(optimizer).__name__
            job_warning(
                sharded.comm, log, "%s holds no optimizer state: %s starts from step 0", directory, name
            )
    return manifest["extra"]


def agreed_manifest(comm, directory: Path, model) -> dict:
    """The manifest of `directory`, the same one on every rank (another job's save over it while the
    ranks read would give some the old and some the new, each consistent: ChangedWhileRead, read
    again), and the model's settings checked against it on every rank (SettingsDiffer). Collective."""
    manifest = collective(comm, lambda: read_manifest(directory), f"loading {directory}")
    if len(set(comm.allgather_object(manifest_digest(manifest)))) > 1:
        raise ChangedWhileRead(f"{directory} changed while it was read (another job saved over it)")
    check = functools.partial(check_settings, manifest, model, directory)
    comm.run_everywhere(check, f"loading {directory}", (SettingsDiffer,), SettingsDiffer)
    return manifest


def filled(comm, directory: Path, manifest: dict, fill):
    """fill() on every rank (collective); where it failed because the checkpoint was saved over
    meanwhile (its manifest is another now), ChangedWhileRead instead, so that the read is retried."""
    try:
        collective(comm, fill, f"loading {directory}")
    except CheckpointError as exc:

        def now():
            try:
                return manifest_digest(read_manifest(directory))
            except CheckpointError:
                return None  # gone, or half replaced

        if comm.broadcast_object(now() if comm.rank == 0 else None) != manifest_digest(manifest):
            raise ChangedWhileRead(f"{directory} changed while it was read: {exc}") from exc
        raise


def read_located(comm, directory: Path, read) -> tuple[Path, object]:
    """(where, read(where)) for the checkpoint named `directory`. A copy an unfinished save left
    nameless is read where it lies; if that read fails because the save's job just renamed it into
    place (a live writer), it is read once more from where it lies now. Collective: rank 0 looks,
    every rank reads."""
    where = readable(comm, directory)
    try:
        return where, read(where)
    except CheckpointError as exc:
        again = readable(comm, directory)
        if again == where and not isinstance(exc, ChangedWhileRead):
            raise
        log.info("%s moved or changed while it was read (a save finished): reading %s", where, again)
        return again, read(again)


def readable(comm, directory: Path) -> Path:
    """Where the checkpoint named `directory` is read from, changing nothing (publish.locate). Collective."""
    found = collective(comm, lambda: publish.locate(directory), f"loading {directory}", root=0)
    return Path(comm.broadcast_object(str(found or directory)))


def _check_fits(manifest: dict, sharded, optimizer=None) -> dict:
    saved = [
        (u["name"], u["dtype"], [(t["name"], t["shape"]) for t in u["tensors"]]) for u in manifest["units"]
    ]
    mine = [
        (r["name"], r["dtype"], [(t["name"], t["shape"]) for t in r["tensors"]])
        for r in map(unit_record, sharded.units)
    ]
    if saved != mine:
        diff = next(
            (f"saved {a} vs model {b}" for a, b in zip(saved, mine) if a != b),
            f"{len(saved)} vs {len(mine)} units",
        )
        raise CheckpointError(f"the checkpoint does not fit this model (first difference: {diff})")
    saved_by = (manifest["optimizer"] or {}).get("name", "AdamW")  # format 1: AdamW only
    if optimizer is not None and manifest["optimizer"] is not None and saved_by != type(optimizer).__name__:
        raise CheckpointError(
            f"the checkpoint holds the state of {saved_by}, the optimizer given is {type(optimizer).__name__}"
        )
    return manifest


def check_settings(manifest: dict, model, directory: Path) -> None:
    """The settings the saved weights were made for (heads, a LayerNorm's eps, the activation) must be
    the model's, module by module where both have the module: other settings over the same shapes
    would compute another function from them, silently. (A checkpoint written before settings were
    saved has none to compare.)"""
    saved = manifest.get("settings") or {}
    mine = json.loads(json.dumps(model.settings(of_the_weights=True))) if hasattr(model, "settings") else {}
    differ = [
        f"{name}.{key}: saved {value!r}, the model's {mine[name][key]!r}"
        for name, values in saved.items()
        for key, value in (values.items() if isinstance(values, dict) else ())
        if name in mine and key in mine[name] and mine[name][key] != value
    ]
    if differ:
        raise SettingsDiffer(
            f"{directory} was saved from a model with other settings ({'; '.join(differ[:3])}"
            f"{'; ...' if len(differ) > 3 else ''}): build the model with the checkpoint's settings"
        )


def _fill(directory: Path, manifest: dict, sharded, optimizer):
    comm = sharded.shard
    stepped = {id(u) for u in optimizer.groups} if optimizer is not None else set()
    for index, unit in enumerate(sharded.units):
        start, stop = flat_range(unit, comm.rank, comm.size)
        targets = {"param": unit.shard}
        saved = {seg["kind"] for f in manifest["files"] for seg in f["segments"] if seg["unit"] == index}
        if id(unit) in stepped:
            if manifest["optimizer"] is not None and saved & set(optimizer.state_kinds):
                targets.update(optimizer.state_of(unit, allocate=True))
            else:  # never stepped when saved, or saved without an optimizer
                optimizer.forget_state(unit)
        for kind, target in targets.items():
            target[...] = 0  # padding stays zero
            for seg_start, data in counted_slices(
                directory, manifest, index, kind, start, stop, sharded.ledger
            ):
                copy_overlap(target, 0, start, stop, seg_start, data)
        unit.zero_grad()


def counted_slices(directory, manifest: dict, index: int, kind: str, start: int, stop: int, ledger):
    """read_slices, each slice counted in the ledger's checkpoint_io while it is in memory."""
    for seg_start, data in read_slices(directory, manifest, index, kind, start, stop):
        ledger.alloc("checkpoint_io", data.nbytes)
        yield seg_start, data
        ledger.free("checkpoint_io", data.nbytes)


def copy_overlap(target, offset: int, lo: int, hi: int, seg_start: int, data):
    """Copy the part of a saved slice (flat positions seg_start onward) inside [lo, hi) into target,
    position lo landing at target[offset]."""
    x, y = max(lo, seg_start), min(hi, seg_start + data.size)
    if x < y:
        target[offset + x - lo : offset + y - lo] = array_module_of(target).asarray(
            data[x - seg_start : y - seg_start]
        )


# -- a directory of checkpoints: step-N, keep the last K, load the newest intact ----------------------


def save_step(root, step: int, model, optimizer=None, extra: dict | None = None, keep: int = 3) -> Path:
    """save() into root/step-XXXXXXXX, then delete all but the newest `keep` step-N checkpoints
    (keep=0: delete none).

    Pruning sees only step-N directories; it also removes incomplete staging directories of older
    steps (saves that died: never complete checkpoints)."""
    if not is_count(step) or not is_count(keep):
        raise ValueError(
            f"save_step: step and keep must be non-negative integers, got step={step!r}, keep={keep!r}"
        )
    comm = require_sharded_units(model).comm
    collective(comm, lambda: lock.hold(lock.root_lock(Path(root))), f"saving to {root}", root=0)
    path = save(Path(root) / f"step-{step:08d}", model, optimizer, {**(extra or {}), "step": step})
    collective(comm, lambda: _prune(Path(root), step, keep), f"pruning {root}", root=0)
    return path


def _prune(root: Path, step: int, keep: int):
    """After a save of `step`: finish interrupted saves (a superseded `.old-*` copy goes), keep the
    newest `keep`, and remove staging of older steps that never completed."""
    kept = _listed_checkpoints(root, publish.recover)
    if keep > 0:
        for old in kept[keep:]:
            publish.remove_ours(old)
    for stale in root.glob(f"step-*{STAGING}*"):
        saved = STEP.fullmatch(stale.name.split(STAGING)[0])
        if saved and int(saved[1]) < step and not (stale / MANIFEST).is_file():
            publish.remove_ours(stale)


def load_latest(
    root, model, optimizer=None, *, missing_ok: bool = False
) -> tuple[Path, dict] | tuple[None, None]:
    """Load the newest step-N checkpoint under `root` that is intact; older ones are tried when newer fail.

    Returns (path, extra), or (None, None) when `root` holds no step-N checkpoint at all. A `root` that
    does not exist is a CheckpointError (a mistyped path must not mean a silent fresh start) unless
    missing_ok=True (a first run that may find nothing). When it holds some but none loads (corrupted,
    or made for another model), raises CheckpointError listing why each failed: starting from scratch
    would silently discard a run. Collective."""
    comm = require_sharded_units(model).comm

    def listing():
        if not Path(root).exists() and not missing_ok:
            raise CheckpointError(
                f"{root} does not exist: check the path, or pass missing_ok=True where a first run "
                "finds no checkpoint directory yet"
            )
        if Path(root).exists() and not Path(root).is_dir():
            raise CheckpointError(f"{root} is not a directory of step-N checkpoints")
        return [str(p) for p in _listed_checkpoints(Path(root), publish.locate)]

    listed, failures = None, []
    for _ in range(10):  # a live writer may prune what was listed while it is read: list again
        now = comm.broadcast_object(collective(comm, listing, f"listing {root}", root=0))
        if now == listed:
            break
        listed, failures = now, []
        for path in listed:
            try:
                return _load(Path(root) / _named(Path(path)), model, optimizer)
            except SettingsDiffer:  # the model is the wrong one: an older checkpoint must not hide it
                raise
            except CheckpointError as exc:
                job_warning(comm, log, "skipping checkpoint %s: %s", path, exc)  # raised on every rank alike
                failures.append(f"{Path(path).name}: {exc}")
    if failures:
        raise CheckpointError(f"no checkpoint under {root} could be loaded:\n  " + "\n  ".join(failures))
    return None, None


def _named(path: Path) -> str:
    """The step-N name of a checkpoint listed where it lies (a nameless save's copy: its name)."""
    return publish.named_by(path) or path.name


def _listed_checkpoints(root: Path, settle) -> list[Path]:
    """checkpoints(root), with each step-N an interrupted save left nameless where `settle` puts it:
    publish.recover for a writer holding the root's lock (renamed back), publish.locate for a reader
    (where it lies, nothing changed). Newest step first."""
    found = {p.name: p for p in checkpoints(root)}
    for name in {publish.named_by(p) for p in root.glob("step-*-*")} if root.is_dir() else ():
        if name and STEP.fullmatch(name):
            where = settle(root / name)
            if where is not None:
                found[name] = where
    return [found[name] for name in sorted(found, key=lambda n: int(STEP.fullmatch(n)[1]), reverse=True)]
