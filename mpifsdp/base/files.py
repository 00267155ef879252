"""Files that appear whole or not at all: written under a temporary name beside the target, fsynced,
renamed over it, and the directory fsynced so that the rename itself survives a crash. Every file
mpifsdp writes goes through here (checkpoint directories through checkpoint/publish.py, which uses
the same fsync_dir)."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def fsync_dir(path: Path):
    """Make a directory's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """A name beside `path` (`<name>.tmp-<id>`) that no other writer picks."""
    return path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")


def replace_durably(tmp: Path, path: Path):
    """Rename a complete, fsynced `tmp` over `path`, and make the rename durable."""
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


@contextlib.contextmanager
def atomic_file(path):
    """`with atomic_file(path) as f:` writes f (binary) whole over `path` at the end of the block, or
    not at all: an exception leaves `path` as it was and removes the temporary file."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
