"""Checkpoint I/O: sharded save and load at any world size (sharded.py; format: docs/checkpoint.md),
the format's validation, fence and checksums (manifest.py), a checkpoint directory on disk (atomic
publication, recovery, deleting only what is ours: publish.py), and one .safetensors file written and
read in per-rank slices (consolidated.py).

`mpifsdp.checkpoint.save(...)` and the rest of sharded.py's functions are here as before.
May import: fsdp, shard, base.
"""

from . import consolidated, lock
from .manifest import CheckpointError, verify
from .publish import recover
from .sharded import checkpoints, load, load_latest, save, save_step

__all__ = [
    "CheckpointError",
    "checkpoints",
    "consolidated",
    "lock",
    "load",
    "load_latest",
    "recover",
    "save",
    "save_step",
    "verify",
]
