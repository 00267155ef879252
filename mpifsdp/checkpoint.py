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

import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np

from .backend import to_numpy
from .fsdp import fsdp_group

log = logging.getLogger(__name__)

FORMAT = "mpifsdp-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
KINDS = ("param", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""


if sys.byteorder != "little":  # pragma: no cover - files are little-endian, arrays are written as-is
    raise ImportError("mpifsdp checkpoints are written from little-endian machines only")


# -- helpers ----------------------------------------------------------------------------------------


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def group_of(model):
    group = fsdp_group(model)
    if group is None:
        raise CheckpointError(
            "checkpoints hold sharded models: call fully_shard(model, Comm()) first (N = 1 works too)"
        )
    return group


def flat_range(unit, rank: int, world: int) -> tuple[int, int]:
    """The unpadded part [start, stop) of the flat vector that `rank` of `world` owns."""
    shard = -(-unit.layout.numel // world)
    return min(rank * shard, unit.layout.numel), min((rank + 1) * shard, unit.layout.numel)


def unit_record(unit) -> dict:
    lay = unit.layout
    return {
        "name": unit.name,
        "dtype": lay.dtype.str,
        "numel": lay.numel,
        "tensors": [
            {"name": n, "shape": list(s), "offset": o} for n, s, o in zip(lay.names, lay.shapes, lay.offsets)
        ],
    }


def collective(comm, action, what: str, root: int | None = None):
    """Run `action()` on every rank (or on `root` only); if it failed anywhere, raise CheckpointError
    on every rank naming each rank's error (a rank failing alone would leave the others waiting)."""
    run = comm.run_everywhere if root is None else (lambda *a, **k: comm.on_root(*a, root=root, **k))
    return run(action, what, catch=(CheckpointError, OSError, ValueError), error_type=CheckpointError)


# -- save -------------------------------------------------------------------------------------------


def save(directory, model, optimizer=None, extra: dict | None = None) -> Path:
    """Write a checkpoint of `model` (and `optimizer`) to `directory`, atomically. Collective.

    Every rank writes only its own slices; `extra` (JSON-serializable: step, data position, RNG seeds)
    goes into the manifest. An existing `directory` is replaced only once the new one is complete.
    """
    group = group_of(model)
    comm = group.comm
    final = Path(directory)
    staging = collective(comm, lambda: _staging_dir(final, comm), f"creating a directory next to {final}")
    moments = _moments_by_unit(optimizer, group)
    record = collective(comm, lambda: _write_rank_file(staging, group, moments), "writing checkpoint files")
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": comm.size,
        "units": [unit_record(u) for u in group.units],
        "files": comm.allgather_object(record),  # every rank's file is on disk (agreed above)
        "optimizer": _optimizer_record(optimizer),
        "extra": extra or {},
    }

    def publish():
        _write_manifest(staging, manifest)
        _move_into_place(staging, final)

    collective(comm, publish, "publishing the checkpoint", root=0)
    return final


def _staging_dir(final: Path, comm) -> Path:
    """A new, empty directory next to `final` (same file system, so the publishing rename is atomic),
    named by rank 0 and created by it. Collective."""
    staging = final.parent / comm.broadcast_object(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    if comm.rank == 0:
        staging.mkdir(parents=True)
    return staging


def _write_manifest(directory: Path, manifest: dict):
    """Written last, and fsynced with its directory: its presence marks the checkpoint complete."""
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _move_into_place(staging: Path, final: Path):
    """Rename the complete checkpoint to its name; an existing one is replaced only now."""
    if final.exists():
        old = final.parent / f"{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)


def _moments_by_unit(optimizer, group) -> dict:
    if optimizer is None:
        return {}
    out = {}
    for i, target in enumerate(optimizer.groups):
        if optimizer.m[i] is not None:
            out[id(target)] = (optimizer.m[i], optimizer.v[i])
    units = {id(u) for u in group.units}
    if optimizer.groups and not set(map(id, optimizer.groups)) <= units:
        raise CheckpointError(
            "the optimizer does not step this model's units: build AdamW(model) after fully_shard"
        )
    return out


def _optimizer_record(optimizer) -> dict | None:
    if optimizer is None:
        return None
    return {
        "step": optimizer.step_count,
        "group_steps": {g.name: n for g, n in zip(optimizer.groups, optimizer.steps)},
        "lr": optimizer.lr,
        "betas": [optimizer.beta1, optimizer.beta2],
        "eps": optimizer.eps,
        "weight_decay": optimizer.weight_decay,
    }


def _write_rank_file(tmp: Path, group, moments: dict) -> dict:
    comm = group.comm
    name = f"rank-{comm.rank:05d}.bin"
    segments, offset = [], 0
    with open(tmp / name, "wb") as f:
        for index, unit in enumerate(group.units):
            start, stop = flat_range(unit, comm.rank, comm.size)
            arrays = {"param": unit.shard}
            if id(unit) in moments:
                arrays["exp_avg"], arrays["exp_avg_sq"] = moments[id(unit)]
            for kind, array in arrays.items():
                data = np.ascontiguousarray(to_numpy(array[: stop - start]))  # no copy on the CPU
                f.write(data)
                digest = hashlib.sha256(data).hexdigest()
                segments.append(
                    {
                        "unit": index,
                        "kind": kind,
                        "start": start,
                        "stop": stop,
                        "offset": offset,
                        "sha256": digest,
                    }
                )
                offset += data.nbytes
        f.flush()
        os.fsync(f.fileno())
    return {"name": name, "bytes": offset, "segments": segments}


# -- find and verify --------------------------------------------------------------------------------


def read_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {directory} is not a complete checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable or corrupted: {exc}") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}"
        )
    for record in manifest["files"]:
        file = Path(directory) / record["name"]
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != record["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} is truncated or overwritten: {file.stat().st_size} bytes, "
                f"the manifest says {record['bytes']}"
            )
    return manifest


def _checksum_matches(raw: bytes, segment: dict) -> bool:
    return hashlib.sha256(raw).hexdigest() == segment["sha256"]


def read_segment(directory: Path, record: dict, segment: dict, dtype: np.dtype) -> np.ndarray:
    file = directory / record["name"]
    count = segment["stop"] - segment["start"]
    with open(file, "rb") as f:
        f.seek(segment["offset"])
        raw = f.read(count * dtype.itemsize)
    if len(raw) != count * dtype.itemsize or not _checksum_matches(raw, segment):
        raise CheckpointError(
            f"checkpoint file {file} is corrupted: the {segment['kind']} bytes of unit #{segment['unit']} "
            "do not match their checksum"
        )
    return np.frombuffer(raw, dtype=dtype)


def read_slices(directory, manifest: dict, unit_index: int, kind: str, start: int, stop: int):
    """(start, values) of each saved `kind` slice of unit #unit_index overlapping [start, stop),
    read and checksum-checked one at a time (so at most one slice is in memory)."""
    dtype = np.dtype(manifest["units"][unit_index]["dtype"])
    for record in manifest["files"]:
        for seg in record["segments"]:
            if (
                seg["unit"] == unit_index
                and seg["kind"] == kind
                and seg["start"] < stop
                and seg["stop"] > start
            ):
                yield seg["start"], read_segment(Path(directory), record, seg, dtype)


def verify(directory) -> dict:
    """Read every segment and check its checksum; returns the manifest or raises CheckpointError."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for record in manifest["files"]:
        for segment in record["segments"]:
            read_segment(directory, record, segment, np.dtype(manifest["units"][segment["unit"]]["dtype"]))
    return manifest


def checkpoints(root) -> list[Path]:
    """Complete checkpoint directories under `root` (those with a manifest), newest step first.

    Directories of a save in progress (`*.tmp-*`) or of one being replaced (`*.old-*`) are never listed.
    """
    root = Path(root)
    found = [
        p
        for p in (root.iterdir() if root.is_dir() else [])
        if p.is_dir() and (p / MANIFEST).is_file() and ".tmp-" not in p.name and ".old-" not in p.name
    ]
    return sorted(found, key=lambda p: p.name, reverse=True)


# -- load -------------------------------------------------------------------------------------------


def load(directory, model, optimizer=None) -> dict:
    """Load a checkpoint saved at any world size into the sharded `model` (and `optimizer`). Collective.

    Each rank reads only the slices that overlap its shard, checks their checksums, and copies them in:
    parameters and AdamW moments come back bit-identical. Returns the checkpoint's `extra`.
    A missing, truncated or corrupted file raises CheckpointError, naming the file, on every rank.
    """
    group = group_of(model)
    directory = Path(directory)
    manifest = collective(
        group.comm, lambda: _check_fits(read_manifest(directory), group), f"loading {directory}"
    )
    collective(group.comm, lambda: _fill(directory, manifest, group, optimizer), f"loading {directory}")
    if optimizer is not None and manifest["optimizer"] is not None:
        record = manifest["optimizer"]
        optimizer.step_count = record["step"]
        # checkpoints written before per-group steps: every group was at the global step
        per_group = record.get("group_steps", {})
        optimizer.steps = [per_group.get(g.name, record["step"]) for g in optimizer.groups]
    return manifest["extra"]


def _check_fits(manifest: dict, group) -> dict:
    saved = [
        (u["name"], u["dtype"], [(t["name"], t["shape"]) for t in u["tensors"]]) for u in manifest["units"]
    ]
    mine = [
        (r["name"], r["dtype"], [(t["name"], t["shape"]) for t in r["tensors"]])
        for r in map(unit_record, group.units)
    ]
    if saved != mine:
        diff = next(
            (f"saved {a} vs model {b}" for a, b in zip(saved, mine) if a != b),
            f"{len(saved)} vs {len(mine)} units",
        )
        raise CheckpointError(f"the checkpoint does not fit this model (first difference: {diff})")
    return manifest


def _fill(directory: Path, manifest: dict, group, optimizer):
    comm = group.comm
    positions = {id(u): i for i, u in enumerate(optimizer.groups)} if optimizer is not None else {}
    for index, unit in enumerate(group.units):
        start, stop = flat_range(unit, comm.rank, comm.size)
        targets = {"param": unit.shard}
        if id(unit) in positions and manifest["optimizer"] is not None:
            targets["exp_avg"], targets["exp_avg_sq"] = optimizer._moments(positions[id(unit)])
        for kind, target in targets.items():
            target[...] = 0  # padding stays zero
            for seg_start, data in read_slices(directory, manifest, index, kind, start, stop):
                group.ledger.alloc("checkpoint_io", data.nbytes)
                lo, hi = max(start, seg_start), min(stop, seg_start + data.size)
                target[lo - start : hi - start] = unit.xp.asarray(data[lo - seg_start : hi - seg_start])
                group.ledger.free("checkpoint_io", data.nbytes)
        unit.zero_grad()


# -- a directory of checkpoints: step-N, keep the last K, load the newest intact ----------------------


def save_step(root, step: int, model, optimizer=None, extra: dict | None = None, keep: int = 3) -> Path:
    """save() into root/step-XXXXXXXX, then delete all but the newest `keep` complete checkpoints."""
    path = save(Path(root) / f"step-{step:08d}", model, optimizer, {**(extra or {}), "step": step})
    comm = group_of(model).comm
    if comm.rank == 0 and keep > 0:
        for old in checkpoints(root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in Path(root).glob("*.tmp-*"):  # left by a save that died: never complete
            shutil.rmtree(stale, ignore_errors=True)
    comm.barrier()
    return path


def load_latest(root, model, optimizer=None) -> tuple[Path, dict] | tuple[None, None]:
    """Load the newest checkpoint under `root` that is intact; older ones are tried when newer fail.

    Returns (path, extra), or (None, None) when there is no complete checkpoint. Collective.
    """
    comm = group_of(model).comm
    candidates = comm.broadcast_object([str(p) for p in checkpoints(root)] if comm.rank == 0 else None)
    for path in candidates:
        try:
            return Path(path), load(path, model, optimizer)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
    return None, None
