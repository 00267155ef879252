"""Byte-level text data: a corpus on every machine without a download, memory-mapped, seeded batches.

The default corpus is the Python standard library's own `.py` files (found through sysconfig),
concatenated in sorted path order: real text that every Python install carries. It is written once
to a cache file (atomically, so concurrent ranks can race safely) and memory-mapped afterwards.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from .base.checks import refuse_below
from .base.files import atomic_file

VOCAB_SIZE = 256  # byte-level tokens


def cache_dir() -> Path:
    """$MPIFSDP_CACHE, else $XDG_CACHE_HOME/mpifsdp, else ~/.cache/mpifsdp. An empty or relative
    XDG_CACHE_HOME is ignored, as the XDG specification says (it wrote 31 MB into the working directory)."""
    if os.environ.get("MPIFSDP_CACHE"):
        path = Path(os.environ["MPIFSDP_CACHE"])
        if path.exists() and not path.is_dir():
            raise ValueError(
                f"MPIFSDP_CACHE={path} is a file, not a directory: name a directory for the cache"
            )
        return path
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "mpifsdp"


def stdlib_sources(package: str = "") -> list[Path]:
    """The standard library's .py files (of one package, e.g. "email", if given) in a fixed order,
    site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if package and not (root / package).is_dir():
        raise FileNotFoundError(f"the standard library has no package {package!r} (in {root})")
    found = (root / package).rglob("*.py")
    return sorted(p for p in found if "site-packages" not in p.relative_to(root).parts and p.is_file())


def _write_atomically(path: Path, chunks):
    with atomic_file(path) as f:
        for chunk in chunks:
            f.write(chunk)


def stdlib_corpus_path(package: str = "") -> Path:
    """Build (once) and return the cached corpus file of the standard library's sources (or of one
    package's); keyed by Python version and file list."""
    sources = stdlib_sources(package)
    key = hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}" for p in sources).encode()).hexdigest()[:12]
    label = f"-{package}" if package else ""
    path = cache_dir() / f"stdlib{label}-py{sys.version_info[0]}{sys.version_info[1]}-{key}.bin"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, (p.read_bytes() for p in sources))
    return path


class TextData:
    """Byte tokens of one file, split train/val by position (the last `val_fraction` is validation)."""

    def __init__(self, path: str | os.PathLike | None = None, val_fraction: float = 0.1):
        if not 0 <= val_fraction < 1:
            raise ValueError(f"TextData: val_fraction {val_fraction} must be in [0, 1)")
        self.path = Path(path) if path is not None else stdlib_corpus_path()
        if not self.path.is_file():
            raise FileNotFoundError(f"text file {self.path} does not exist")
        if self.path.stat().st_size == 0:  # np.memmap's own error does not name the file
            raise ValueError(f"text file {self.path} is empty: give a file with some text to train on")
        self.tokens = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.val_fraction = val_fraction
        n_val = int(len(self.tokens) * val_fraction)
        self.splits = {
            "train": self.tokens[: len(self.tokens) - n_val],
            "val": self.tokens[len(self.tokens) - n_val :],
        }

    def batch(self, split: str, batch_size: int, block_size: int, rng: np.random.Generator):
        """(x, y) int64 arrays of shape (batch_size, block_size); y is x shifted by one token."""
        if split not in self.splits:
            raise ValueError(f"TextData: split {split!r} is not one of {sorted(self.splits)}")
        refuse_below("TextData.batch", integers=True, batch_size=(batch_size, 1), block_size=(block_size, 1))
        self._require_tokens(split, block_size)
        data = self.splits[split]
        starts = rng.integers(0, len(data) - block_size - 1, size=batch_size)
        x = np.stack([data[s : s + block_size] for s in starts]).astype(np.int64)
        y = np.stack([data[s + 1 : s + 1 + block_size] for s in starts]).astype(np.int64)
        return x, y

    def check_fits(self, block_size: int):
        """Refuse, before training starts, a file whose train or validation split is too short for
        `block_size` (found otherwise at the first evaluation, maybe hours in)."""
        refuse_below("TextData.check_fits", integers=True, block_size=(block_size, 1))
        for split in self.splits:
            self._require_tokens(split, block_size)

    def _require_tokens(self, split: str, block_size: int):
        if len(self.splits[split]) <= block_size + 1:
            raise ValueError(
                f"{self.path}: its {split} split has {len(self.splits[split])} tokens, not more than "
                f"block_size+1 = {block_size + 1}: give a longer file, a smaller block_size, or another "
                f"val_fraction (now {self.val_fraction})"
            )

    def global_batch(self, split, step, batch_size, block_size, seed=0):
        """The same global batch on every rank for (seed, split, step): slice it by rank for data parallel."""
        refuse_below("TextData.global_batch", integers=True, step=(step, 0), seed=(seed, 0))
        rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
        return self.batch(split, batch_size, block_size, rng)


def rank_slice(array, rank: int, world_size: int, even: bool = True):
    """Rank's contiguous share of the leading axis.

    even=True: the rows must divide evenly (what fully_shard's models need: equal batches).
    even=False: any number of rows; the first `n % world_size` ranks get one row more. Pass
    `weight=len(rows)` to Unit.reduce_grad so the ranks' gradients average to the global mean."""
    refuse_below("rank_slice", integers=True, world_size=(world_size, 1), rank=(rank, 0))
    if rank >= world_size:
        raise ValueError(f"rank_slice: rank {rank} is not below world_size {world_size}")
    if np.ndim(array) == 0:
        raise ValueError("rank_slice: the array has no axis to split (a scalar)")
    n = len(array)
    if even and n % world_size:
        raise ValueError(
            f"{n} rows do not divide over {world_size} ranks: make it a multiple, or pass even=False "
            "and weight each rank's gradient by its row count (Unit.reduce_grad(weight=...))"
        )
    per, extra = divmod(n, world_size)
    start = rank * per + min(rank, extra)
    return array[start : start + per + (rank < extra)]


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the byte frequencies: the loss of the best context-free predictor."""
    counts = np.bincount(np.asarray(tokens), minlength=VOCAB_SIZE).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
