"""The checkpoint format on disk: a manifest, validated and checksummed, and the slices it points to.

A manifest is trusted only after it is proven whole and consistent (docs/checkpoint.md): its own
SHA-256 matches (format version 2; version 1 had none and still loads), every field has the type and
range it must have, every slice lies inside its file, and each unit's slices of each kind tile the
unit's flat vector exactly once. Anything else is "not a valid checkpoint: PATH (why)": a damaged
or edited manifest can never load parameters as zeros or in the wrong place. The slices themselves
are checked against their own SHA-256 when read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from ..base.checks import is_count

FORMAT = "mpifsdp-checkpoint"
VERSION = 2  # 2: the manifest carries its own checksum; 1 (no checksum) still loads
MANIFEST = "manifest.json"
KINDS = ("param", "exp_avg", "exp_avg_sq", "momentum_buffer")  # parameters, then optimizer state
FLOAT_DTYPES = {np.dtype(t).str for t in ("<f2", "<f4", "<f8")}
MAX_MANIFEST = 2**30  # bytes: far above what a checkpoint of a million slices writes (~200 MiB)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""


class ChangedWhileRead(CheckpointError):
    """A checkpoint another job saved over while this one read it: read again (no mix of two)."""


class SettingsDiffer(CheckpointError):
    """The model's settings (heads, eps) are not those the checkpoint's weights were made for."""


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's content without its own checksum, in a canonical JSON form."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def with_digest(manifest: dict) -> dict:
    return {**manifest, "sha256": manifest_digest(manifest)}


def inside(directory: Path, name: str) -> Path:
    """directory/name, refused unless it resolves (links followed) to a file inside `directory`.

    [Note: the fence] A checkpoint may come from anyone: the names its manifest gives are plain file
    names (checked in _validate) and a link may not lead out, so loading reads nothing outside the
    checkpoint. The error says which name was refused, never anything about where it leads."""
    path = directory / name
    fence = os.path.realpath(directory)
    if os.path.commonpath([fence, os.path.realpath(path)]) != fence:
        raise CheckpointError(f"not a valid checkpoint: {directory} ({name!r} leads out of the checkpoint)")
    return path


def read_manifest(directory) -> dict:
    """The manifest of checkpoint `directory`, proven whole and consistent, with its files present."""
    directory = Path(directory)
    path = inside(directory, MANIFEST)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {directory} is not a complete checkpoint")
    if path.stat().st_size > MAX_MANIFEST:
        raise CheckpointError(
            f"not a valid checkpoint: {directory} (a manifest of {path.stat().st_size} bytes, more than "
            f"any checkpoint writes: {MAX_MANIFEST})"
        )
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(
            f"not a valid checkpoint: {directory} (its manifest is unreadable: {exc})"
        ) from None
    try:
        _validate(manifest)
    except (KeyError, TypeError, ValueError) as exc:
        why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(f"not a valid checkpoint: {directory} ({why})") from None
    for record in manifest["files"]:
        file = inside(directory, record["name"])
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != record["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} is truncated or overwritten: {file.stat().st_size} bytes, "
                f"the manifest says {record['bytes']}"
            )
    return manifest


def is_plain_name(name) -> bool:
    """A file name with no directory part: no separator, not . or .., no NUL, not absolute."""
    seps = {"/", "\\", os.sep, os.altsep or "/"}
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and not any(sep in name for sep in seps)
    )


def require(ok: bool, why: str):
    """Validation of a file's content: a ValueError saying why, turned into "not a valid ... (why)"."""
    if not ok:
        raise ValueError(why)


def _validate(manifest):
    require(isinstance(manifest, dict), "the manifest is not a JSON object")
    require(manifest.get("format") == FORMAT, f"format {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("version")
    require(version in (1, 2), f"format version {version!r}; this mpifsdp reads versions 1 and 2")
    if version >= 2:
        require(manifest.get("sha256") == manifest_digest(manifest), "the manifest's checksum does not match")
    require(is_count(manifest["world_size"], 1), "world_size must be a positive integer")
    units = manifest["units"]
    require(isinstance(units, list), "units must be a list")
    for u in units:
        _validate_unit(u)
    names = [record["name"] for record in manifest["files"]]
    for name in names:
        require(is_plain_name(name), f"file name {name!r} is not a plain file name in the checkpoint")
    require(len(set(names)) == len(names), "a file is named twice")
    coverage: dict = {}
    for record in manifest["files"]:
        require(is_count(record["bytes"]), f"{record['name']}: bytes must be a non-negative integer")
        for s in record["segments"]:
            _validate_segment(record, s, units)
            coverage.setdefault((s["unit"], s["kind"]), []).append((s["start"], s["stop"]))
    for index, unit in enumerate(units):
        for kind in KINDS:
            ranges = sorted(r for r in coverage.get((index, kind), []) if r[0] < r[1])
            if kind != "param" and not ranges:
                continue  # no moments saved for this unit (never stepped)
            require(
                _tiles(ranges, unit["numel"]),
                f"unit {unit['name']!r}: its {kind} slices do not cover it once",
            )


def _validate_unit(u: dict):
    """A unit record: a name, a float dtype, and tensors laid end to end over exactly numel elements."""
    require(isinstance(u["name"], str), "a unit's name must be a string")
    require(u["dtype"] in FLOAT_DTYPES, f"unit {u['name']!r}: dtype {u['dtype']!r} is not a float dtype")
    require(is_count(u["numel"]), f"unit {u['name']!r}: numel must be a non-negative integer")
    end = 0
    for t in u["tensors"]:
        require(isinstance(t["name"], str), f"unit {u['name']!r}: a tensor's name must be a string")
        require(
            isinstance(t["shape"], list) and all(is_count(d) for d in t["shape"]),
            f"{t['name']}: bad shape",
        )
        require(t["offset"] == end, f"{t['name']}: offset {t['offset']!r}, expected {end}")
        end += math.prod(t["shape"])  # Python ints: a crafted shape cannot wrap around
    require(
        end == u["numel"], f"unit {u['name']!r}: its tensors hold {end} elements, numel says {u['numel']}"
    )


def _validate_segment(record: dict, s: dict, units: list):
    """One slice of a file: a known unit and kind, inside the unit, inside the file, with a checksum."""
    require(is_count(s["unit"]) and s["unit"] < len(units), f"{record['name']}: unit index {s['unit']!r}")
    require(s["kind"] in KINDS, f"{record['name']}: kind {s['kind']!r} is none of {KINDS}")
    unit = units[s["unit"]]
    require(
        is_count(s["start"]) and is_count(s["stop"]) and s["start"] <= s["stop"] <= unit["numel"],
        f"{record['name']}: slice [{s['start']!r}, {s['stop']!r}) outside unit {unit['name']!r}",
    )
    nbytes = (s["stop"] - s["start"]) * np.dtype(unit["dtype"]).itemsize
    require(
        is_count(s["offset"]) and s["offset"] + nbytes <= record["bytes"],
        f"{record['name']}: a slice at offset {s['offset']!r} runs past the file's end",
    )
    require(isinstance(s["sha256"], str) and len(s["sha256"]) == 64, f"{record['name']}: bad sha256")


def _tiles(ranges: list, numel: int) -> bool:
    """Whether sorted non-empty [start, stop) ranges cover [0, numel) exactly once."""
    position = 0
    for start, stop in ranges:
        if start != position:
            return False
        position = stop
    return position == numel


def slice_digest(segment: dict, data, version: int = VERSION) -> str:
    """SHA-256 of a slice's bytes; from version 2 also of where they belong (unit, kind, range), so a
    manifest whose slices were swapped or moved fails the check even with its own checksum redone."""
    where = (
        "" if version < 2 else f"{segment['unit']}:{segment['kind']}:{segment['start']}:{segment['stop']}:"
    )
    return hashlib.sha256(where.encode() + bytes(memoryview(data).cast("B"))).hexdigest()


def _checksum_matches(raw: bytes, segment: dict, version: int) -> bool:
    return slice_digest(segment, raw, version) == segment["sha256"]


def read_segment(directory: Path, manifest: dict, record: dict, segment: dict) -> np.ndarray:
    file = inside(directory, record["name"])
    dtype = np.dtype(manifest["units"][segment["unit"]]["dtype"])
    count = segment["stop"] - segment["start"]
    with open(file, "rb") as f:
        f.seek(segment["offset"])
        raw = f.read(count * dtype.itemsize)
    if len(raw) != count * dtype.itemsize or not _checksum_matches(raw, segment, manifest["version"]):
        raise CheckpointError(
            f"checkpoint file {file} is corrupted: the {segment['kind']} bytes of unit #{segment['unit']} "
            "do not match their checksum"
        )
    return np.frombuffer(raw, dtype=dtype)


def read_slices(directory, manifest: dict, unit_index: int, kind: str, start: int, stop: int):
    """(start, values) of each saved `kind` slice of unit #unit_index overlapping [start, stop),
    read and checksum-checked one at a time (so at most one slice is in memory)."""
    for record in manifest["files"]:
        for seg in record["segments"]:
            overlaps = seg["start"] < stop and seg["stop"] > start
            if seg["unit"] == unit_index and seg["kind"] == kind and overlaps:
                yield seg["start"], read_segment(Path(directory), manifest, record, seg)


def verify(directory) -> dict:
    """Read every segment and check its checksum; returns the manifest or raises CheckpointError."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for record in manifest["files"]:
        for segment in record["segments"]:
            read_segment(directory, manifest, record, segment)
    return manifest


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
