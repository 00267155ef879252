"""Parameters by tensor name, whatever the units: one consolidated .safetensors file written from and
read into shards, a slice per rank; and a sharded checkpoint's parameters loaded into a model divided
into other units (load_params: fine-tuning a base with frozen parts or adapters).

The file is what the `safetensors` package (and so PyTorch and Hugging Face tools) reads: an 8-byte
header length, a JSON header (name -> dtype, shape, data offsets), then the tensors' bytes. We lay
tensors out unit by unit in layout order, and every rank writes the pieces of the tensors in its
shard at their offsets: no rank holds more than its shard. Reading works for any tensor order: each
rank reads the byte ranges of the tensor pieces in its shard.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ..base.backend import to_numpy
from ..base.checks import is_count
from ..base.files import atomic_file, removed_if_terminated, replace_durably, temporary_name
from .manifest import CheckpointError, read_manifest, read_slices, require, unit_record
from .sharded import (
    agreed_manifest,
    collective,
    copy_overlap,
    counted_slices,
    filled,
    read_located,
    require_sharded_units,
    sharded_units,
)

_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64", "int32": "I32"}
_NUMPY_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def safetensors_header(entries, metadata: dict | None = None) -> bytes:
    """entries: [(name, dtype, shape)] in data order; returns the 8-byte length + JSON header.
    metadata: more string -> string entries for __metadata__ (e.g. the model's config)."""
    header, offset = {"__metadata__": {"format": "pt", "writer": "mpifsdp", **(metadata or {})}}, 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype.name],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _unit_entries(units_records) -> list:
    """[(name, dtype, shape)] of every tensor, unit by unit in layout order."""
    return [(t["name"], np.dtype(u["dtype"]), t["shape"]) for u in units_records for t in u["tensors"]]


def export_safetensors(path, model, include=lambda name: True) -> Path:
    """Write the sharded model's parameters (those whose name `include` accepts) to one .safetensors
    file. Collective.

    Tensors are laid out unit by unit in layout order, so every rank writes the pieces of its own
    shard at their offsets (a shared file system is assumed, as for checkpoints). No rank ever holds
    more than its shard. A file at `path` is replaced only once the new one is complete; a failed
    export raises CheckpointError on every rank and leaves nothing behind.
    """
    sharded = require_sharded_units(model)
    comm = sharded.comm
    path = Path(path)
    entries = [e for e in _unit_entries(unit_record(u) for u in sharded.units) if include(e[0])]
    if not entries:  # every rank: the same entries
        raise CheckpointError(f"exporting {path}: `include` accepted none of the model's tensors")
    collective(comm, lambda: require_export_path(path), f"exporting {path}", root=0)
    header = safetensors_header(entries)
    offsets, data_bytes = {}, 0
    for name, dtype, shape in entries:
        offsets[name], data_bytes = data_bytes, data_bytes + math.prod(shape) * dtype.itemsize
    tmp = Path(comm.broadcast_object(str(temporary_name(path))))

    def create():
        with open(tmp, "wb") as f:
            f.write(header)
            f.truncate(len(header) + data_bytes)

    with removed_if_terminated(tmp):
        try:
            collective(comm, create, f"creating {path}", root=0)
            collective(comm, lambda: _write_pieces(tmp, sharded, offsets, len(header)), f"writing {path}")
            collective(comm, lambda: replace_durably(tmp, path), f"publishing {path}", root=0)
        except CheckpointError:  # nothing left behind but what was there before
            collective(comm, lambda: tmp.unlink(missing_ok=True), f"cleaning up {tmp}", root=0)
            raise
    return path


def require_export_path(path):
    """Refuse a path an export cannot write (a directory; a folder above it that is a file, or that
    cannot be written), so that a script can check it before it trains, not after. A file there may be
    replaced (the caller named it)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory: give the .safetensors file's path")
    existing = next(p for p in [path.parent, *path.parent.parents] if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise CheckpointError(f"cannot export to {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot export to {path}: {existing} cannot be written (permission)")


def _write_pieces(tmp: Path, sharded, offsets: dict, data_start: int):
    """This rank's pieces of every exported tensor, at their offsets in `tmp` (fsynced)."""
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for unit in sharded.units if sharded.writes else ():  # HSDP: the first group's copy
            little = unit.layout.dtype.newbyteorder("<")
            for name, t0, t1, s0 in unit.layout.pieces_in_shard(sharded.shard.rank):
                if name in offsets:
                    raw = to_numpy(unit.shard[s0 : s0 + t1 - t0]).astype(little).tobytes()
                    os.pwrite(fd, raw, data_start + offsets[name] + t0 * unit.layout.dtype.itemsize)
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_HEADER = 100 * 2**20  # the safetensors package refuses larger headers too


def read_safetensors_header(path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where the data starts), for a file proven valid.

    Checked as the `safetensors` package checks it, before anything is allocated from the file's
    numbers: the header length fits the file, the header is a JSON object of known dtypes and
    non-negative shapes, each tensor's byte range matches its shape and the ranges tile the data
    section exactly. Otherwise: CheckpointError "not a valid safetensors file: PATH (why)"."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            require(size >= 8, f"{size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", f.read(8))
            require(length <= min(size - 8, MAX_HEADER), f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        require(isinstance(header, dict), "the header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        require(isinstance(metadata, dict), "__metadata__ is not an object")
        ranges = []
        for name, entry in header.items():
            require(isinstance(entry, dict) and entry.get("dtype") in _ST_ITEMSIZE, f"{name}: unknown dtype")
            shape, offsets = entry.get("shape"), entry.get("data_offsets")
            require(
                isinstance(shape, list) and all(is_count(d) for d in shape), f"{name}: bad shape {shape!r}"
            )
            require(
                isinstance(offsets, list) and len(offsets) == 2 and all(is_count(o) for o in offsets),
                f"{name}: bad data_offsets {offsets!r}",
            )
            nbytes = math.prod(shape) * _ST_ITEMSIZE[entry["dtype"]]
            require(offsets[1] - offsets[0] == nbytes, f"{name}: data_offsets {offsets} do not hold {shape}")
            ranges.append(tuple(offsets))
        end = 0
        for start, stop in sorted(ranges):
            require(start == end, "tensor byte ranges overlap or leave a gap")
            end = stop
        require(8 + length + end == size, f"the tensors end at byte {8 + length + end}, the file at {size}")
    except (OSError, ValueError, struct.error) as exc:  # ValueError: bad JSON, bad UTF-8, checks above
        raise CheckpointError(f"not a valid safetensors file: {path} ({exc})") from None
    return header, 8 + length


def safetensors_metadata(path) -> dict:
    """The string -> string `__metadata__` of a safetensors file read_safetensors_header proved valid
    (e.g. the model config an export wrote beside its weights)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(length)).get("__metadata__", {})
    return {k: v for k, v in metadata.items() if isinstance(k, str) and isinstance(v, str)}


def read_tensor(f, entry: dict, data_start: int, start: int = 0, stop: int | None = None):
    """Elements [start, stop) (default all) of the flattened tensor a validated header `entry`
    describes, from the open file `f`, in native byte order."""
    dtype = np.dtype(_NUMPY_DTYPES[entry["dtype"]])
    stop = math.prod(entry["shape"]) if stop is None else stop
    f.seek(data_start + entry["data_offsets"][0] + start * dtype.itemsize)
    return np.frombuffer(f.read((stop - start) * dtype.itemsize), dtype=dtype.newbyteorder("<")).astype(dtype)


def load_safetensors(path, model, strict: bool = True):
    """Initialise `model` (sharded or not) from a .safetensors file; each rank reads only its slices.

    Every parameter must be in the file with its shape and dtype; with strict (the default) the file
    may hold nothing else. Errors are CheckpointError, on every rank of a sharded model."""
    sharded = sharded_units(model)
    if sharded is None:
        return _load_safetensors(path, model, strict)
    return collective(sharded.comm, lambda: _load_safetensors(path, model, strict), f"loading {path}")


def _load_safetensors(path, model, strict: bool):
    header, data_start = read_safetensors_header(path)
    sharded = sharded_units(model)
    expected = (
        {
            n: (tuple(s), u.layout.dtype)
            for u in sharded.units
            for n, s in zip(u.layout.names, u.layout.shapes)
        }
        if sharded
        else {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    )
    problems = [f"missing {n}" for n in expected if n not in header]
    if strict:
        problems += [f"unexpected {n} (strict=False ignores it)" for n in header if n not in expected]
    problems += [
        f"{n}: file has {header[n]['shape']} {header[n]['dtype']}, model wants {list(s)} {_ST_DTYPES[d.name]}"
        for n, (s, d) in expected.items()
        if n in header and (tuple(header[n]["shape"]) != s or header[n]["dtype"] != _ST_DTYPES[d.name])
    ]
    if problems:
        raise CheckpointError(f"{path} does not fit the model: {'; '.join(problems[:5])}")

    with open(path, "rb") as f:
        if sharded is None:
            for name, p in model.named_parameters():
                p.data[...] = p.xp.asarray(read_tensor(f, header[name], data_start).reshape(p.shape))
            return
        for unit in sharded.units:
            unit.shard[...] = 0
            for name, t0, t1, s0 in unit.layout.pieces_in_shard(sharded.shard.rank):
                unit.shard[s0 : s0 + t1 - t0] = unit.xp.asarray(
                    read_tensor(f, header[name], data_start, t0, t1)
                )


def export_checkpoint(directory, path) -> Path:
    """A saved checkpoint to one .safetensors file, in one process, one slice in memory at a time."""
    directory, path = Path(directory), Path(path)
    manifest = read_manifest(directory)
    header = safetensors_header(_unit_entries(manifest["units"]))
    with atomic_file(path) as out:
        out.write(header)
        base = len(header)
        for index, unit in enumerate(manifest["units"]):
            dtype = np.dtype(unit["dtype"])
            for seg_start, data in read_slices(directory, manifest, index, "param", 0, unit["numel"]):
                out.seek(base + seg_start * dtype.itemsize)
                out.write(data.tobytes())
            base += unit["numel"] * dtype.itemsize
        out.truncate(base)
    return path


# -- a checkpoint's parameters by name -------------------------------------------------------------


def load_params(directory, model, allow_missing=lambda name: False) -> list[str]:
    """Parameters only, matched by tensor name, from a checkpoint saved at any world size and with
    any division into units (e.g. a base model's, into a model that adds adapters or freezes part of
    it, which divides its units differently). Collective.

    Every checkpoint tensor must exist in the model with the same shape and dtype; a model tensor the
    checkpoint lacks keeps its value if allow_missing(name) says so, and is an error otherwise.
    Returns the names of the model's tensors that were not loaded. No optimizer state is loaded.
    """
    sharded = require_sharded_units(model)

    def read(where: Path) -> list[str]:
        manifest = agreed_manifest(sharded.comm, where, model)
        _, missing = collective(
            sharded.comm, lambda: _check_names(manifest, sharded, allow_missing), f"loading {where}"
        )
        filled(sharded.comm, where, manifest, lambda: _fill_by_name(where, manifest, sharded))
        return missing

    return read_located(sharded.comm, Path(directory), read)[1]


def saved_extra(directory) -> dict:
    """The `extra` a checkpoint was saved with (train_gpt.py: the model config and step), from its
    validated manifest alone, so a model can be built to fit before loading. Not collective."""
    return read_manifest(Path(directory))["extra"]


def _check_names(manifest: dict, sharded, allow_missing) -> tuple[dict, list[str]]:
    saved = {t["name"]: (u["dtype"], t["shape"]) for u in manifest["units"] for t in u["tensors"]}
    mine = {
        t["name"]: (r["dtype"], t["shape"]) for r in map(unit_record, sharded.units) for t in r["tensors"]
    }
    problems = [f"{n}: saved {saved[n]}, model {mine[n]}" for n in saved if n in mine and saved[n] != mine[n]]
    extra = sorted(set(saved) - set(mine))
    missing = sorted(set(mine) - set(saved))
    refused = [n for n in missing if not allow_missing(n)]
    if problems or extra or refused:
        raise CheckpointError(
            "the checkpoint's parameters do not fit this model: "
            + "; ".join(
                [f"(dtype, shape) differ for {problems}"] * bool(problems)
                + [f"tensors the model does not have: {extra}"] * bool(extra)
                + [f"tensors the checkpoint lacks: {refused} (allow_missing decides which may be)"]
                * bool(refused)
            )
        )
    return manifest, missing


def _fill_by_name(directory: Path, manifest: dict, sharded):
    """Each rank copies the saved ranges of its shard's tensor pieces, reading each saved slice once
    per unit that needs it."""
    where = {t["name"]: (i, t["offset"]) for i, u in enumerate(manifest["units"]) for t in u["tensors"]}
    rank = sharded.shard.rank
    for unit in sharded.units:
        wanted: dict[int, list] = {}  # saved unit index -> [(saved start, saved stop, shard start)]
        for name, t0, t1, s0 in unit.layout.pieces_in_shard(rank):
            if name in where:
                index, offset = where[name]
                wanted.setdefault(index, []).append((offset + t0, offset + t1, s0))
        for index, pieces in wanted.items():
            lo, hi = min(a for a, _, _ in pieces), max(b for _, b, _ in pieces)
            for seg_start, data in counted_slices(
                directory, manifest, index, "param", lo, hi, sharded.ledger
            ):
                for a, b, s0 in pieces:
                    copy_overlap(unit.shard, s0, a, b, seg_start, data)
