"""FlatLayout: where each named tensor of a unit lives in one flat, padded vector (pure metadata);
agreed_layout: the collective check that every rank built the same one from the same values; and
UnshardedParams: name -> view of a gathered vector, refused once the block that gathered it ended.

The flat vector has padded_numel = ceil(numel / N) * N elements so it splits into N equal shards;
rank r owns [r * shard_numel, (r + 1) * shard_numel). The padding tail is never part of a tensor.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..base.backend import bytes_digest


@dataclass(frozen=True)
class FlatLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    world_size: int
    offsets: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self):
        if len(self.names) != len(self.shapes):
            raise ValueError(f"{len(self.names)} names for {len(self.shapes)} shapes")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate tensor names in layout: {self.names}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        sizes = [math.prod(s) for s in self.shapes]
        object.__setattr__(self, "offsets", tuple(int(o) for o in np.cumsum([0] + sizes[:-1])))
        object.__setattr__(self, "numel", int(sum(sizes)))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @classmethod
    def of(cls, named_arrays, world_size: int, dtype=None) -> FlatLayout:
        """Layout of [(name, array), ...] in that order; dtype defaults to the arrays' common dtype."""
        named_arrays = list(named_arrays)
        for name, a in named_arrays:
            if not (hasattr(a, "dtype") and hasattr(a, "shape")):
                raise TypeError(
                    f"parameter {name!r} is a {type(a).__name__}, not an array: pass np.asarray(value, "
                    "dtype=np.float64) (a scalar becomes a 0-d array)"
                )
            if np.dtype(a.dtype).kind != "f":
                raise TypeError(
                    f"parameter {name!r} is a {a.dtype} array: parameters must be floating point "
                    "(float16, float32 or float64) to be trained"
                )
        dtypes = {np.dtype(a.dtype) for _, a in named_arrays}
        if dtype is not None and np.dtype(dtype).kind != "f":
            raise TypeError(f"a unit's dtype must be floating point, got {np.dtype(dtype)}")
        if dtype is None:
            if len(dtypes) > 1:
                raise TypeError(f"a unit needs one dtype, found {sorted(map(str, dtypes))}: cast first")
            dtype = dtypes.pop() if dtypes else np.float32
        return cls(
            tuple(n for n, _ in named_arrays),
            tuple(tuple(a.shape) for _, a in named_arrays),
            dtype,
            world_size,
        )

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def sizes(self):
        return [math.prod(s) for s in self.shapes]

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat) -> dict:
        """name -> view of `flat` (a full, padded vector) with that tensor's shape."""
        if flat.shape != (self.padded_numel,):
            raise ValueError(f"views need a flat vector of {self.padded_numel} elements, got {flat.shape}")
        return {
            name: flat[o : o + n].reshape(shape)
            for name, shape, o, n in zip(self.names, self.shapes, self.offsets, self.sizes())
        }

    def pieces_in_shard(self, rank: int):
        """(name, tensor_start, tensor_stop, shard_start) for each tensor's part inside rank's shard."""
        lo, hi = self.shard_range(rank)
        for name, o, n in zip(self.names, self.offsets, self.sizes()):
            start, stop = max(o, lo), min(o + n, hi)
            if start < stop:
                yield name, start - o, stop - o, start - lo

    def fill_shard(self, shard, arrays: dict, rank: int, xp):
        """Write rank's slice of the full `arrays` (name -> array) into `shard` (its padding untouched):
        how a rank makes its shard, and how a phantom keeps its peers' (comm/phantom.py)."""
        for name, t0, t1, s0 in self.pieces_in_shard(rank):
            shard[s0 : s0 + t1 - t0] = xp.asarray(arrays[name]).reshape(-1)[t0:t1]

    def decay_segments(self, rank: int, decays=lambda name, shape: len(shape) >= 2) -> list[tuple[int, int]]:
        """Shard-local [start, stop) ranges of the tensors for which decays(name, shape) is true."""
        shapes = dict(zip(self.names, self.shapes))
        return [
            (s0, s0 + t1 - t0)
            for name, t0, t1, s0 in self.pieces_in_shard(rank)
            if decays(name, shapes[name])
        ]

    def fingerprint(self) -> str:
        """A short hash of names, shapes and dtype: equal on every rank or the layouts differ."""
        text = repr((self.names, self.shapes, self.dtype.str))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        n = len(self.names)
        return f"{n} tensors, {self.numel} elements of {self.dtype} (padded to {self.padded_numel})"


def agreed_layout(name: str, named_arrays, comm, dtype, check_values: bool) -> FlatLayout:
    """Build the layout and check, collectively, that every rank built the same one from the same
    values: ranks that start from different values would train a silent mixture of models."""
    layout, error, values = None, None, None
    try:
        layout = FlatLayout.of(named_arrays, comm.size, dtype)
        if layout.numel == 0:
            error = "has no parameters: give it at least one array, or leave it out"
        elif check_values:
            values = bytes_digest(a for _, a in named_arrays)
    except (TypeError, ValueError) as exc:
        error = str(exc)
    everyone = comm.allgather_object(None if layout is None else (layout.fingerprint(), values))
    if error is None and len({fp for fp, _ in everyone}) > 1:
        error = (
            f"layout differs between ranks ({layout.describe()} here, fingerprints "
            f"{[fp for fp, _ in everyone]}): build the model identically on every rank (same config)"
        )
    elif error is None and len({v for _, v in everyone}) > 1:
        groups = {}
        for rank, (_, digest) in enumerate(everyone):
            groups.setdefault(digest, []).append(rank)
        error = (
            f"starts from different parameter values on different ranks (ranks grouped by value: "
            f"{sorted(groups.values())}): build it from the same seed on every rank, or pass "
            "sync_params=True to fully_shard (sync_values=True to Unit) to take rank 0's values"
        )
    comm.raise_if_any(error and f"unit {name!r} {error}", f"creating unit {name!r}")
    return layout


def require_same_edit(name: str, full, comm):
    """Collective: a ValueError on every rank where the ranks' edits of `full` are not bitwise equal.

    The same edit by the same code on the same values gives the same bits on every rank, so the check
    is exact (Comm.require_same: NaN a value like any other; a tolerance let small or permuted edits
    through). An edit that depends on the rank (its data, its random numbers) or on its thread count
    must be made on one rank and broadcast."""
    comm.require_same(
        full,
        f"unit {name!r}: writeback edits",
        "every rank must make the same edit, or each keeps its own slice of a different one",
    )


class UnshardedParams(Mapping):
    """name -> full parameter array, valid only inside `Unit.unsharded()`: after the block the
    parameters may have changed (an optimizer step), so access is refused rather than stale."""

    def __init__(self, unit: str, views: dict):
        self._unit, self._views = unit, views

    def close(self):
        self._views = None

    def _open(self) -> dict:
        if self._views is None:
            raise RuntimeError(
                f"unit {self._unit!r}: its parameters were used after its `unsharded()` block, where "
                "they may be stale; use them inside the block (keep the arrays you need from it)"
            )
        return self._views

    def __getitem__(self, name):
        return self._open()[name]

    def __iter__(self):
        return iter(self._open())

    def __len__(self):
        return len(self._open())
