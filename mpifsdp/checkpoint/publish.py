"""How a checkpoint directory appears on disk: atomically, recoverably; removed only as far as ours.

A save writes into a staging directory next to its destination (`<name>.tmp-<id>`, the same file
system, so the final rename is atomic), writes the manifest last, and renames it into place; an
existing checkpoint is first moved aside (`<name>.old-<id>`). `recover` finishes what a killed save
left (a writer's step); `locate` finds a checkpoint to read without changing anything (a reader's).
Nothing here follows a symbolic link out of a directory, and `remove_ours` deletes only the files a
checkpoint is made of (manifest.json, rank-NNNNN.bin): a user's own file beside them, and the
directory holding it, stay where they are.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import uuid
from pathlib import Path

from ..base.files import fsync_dir
from .manifest import MANIFEST, CheckpointError, with_digest

log = logging.getLogger(__name__)

STAGING, REPLACED = ".tmp-", ".old-"  # suffixes of a save in progress and of a checkpoint being replaced
RANK_FILE = re.compile(r"rank-\d{5}\.bin")  # what each rank writes
PARTIAL_MANIFEST = f".{MANIFEST}.partial"  # the manifest while it is written, renamed once whole


def is_ours(path: Path) -> bool:
    """A regular file (not a link) with a name a checkpoint's files have."""
    named_ours = path.name in (MANIFEST, PARTIAL_MANIFEST) or RANK_FILE.fullmatch(path.name)
    return bool(named_ours) and path.is_file() and not path.is_symlink()


def is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def prepare(final: Path):
    """Refuse a destination that cannot take a checkpoint (changing nothing); finish an interrupted
    overwrite first."""
    if final.is_symlink():
        raise CheckpointError(
            f"cannot save to {final}: it is a symbolic link (a checkpoint is renamed into place, which "
            "would replace the link); save to the directory it points to"
        )
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"cannot save to {final}: it exists and is not a directory")
    if final.is_dir() and any(final.iterdir()):
        foreign = sorted(p.name for p in final.iterdir() if not is_ours(p))
        if foreign or not (final / MANIFEST).is_file():
            what = (
                f"files that are not a checkpoint's ({', '.join(foreign[:5])})"
                if foreign
                else "rank files but no manifest (an incomplete checkpoint)"
            )
            raise CheckpointError(
                f"cannot save to {final}: it holds {what}; choose an empty or new directory, or move "
                "them (nothing there was changed)"
            )
    recover(final)


def staging_dir(final: Path, comm) -> Path:
    """A new, empty directory next to `final`, named by rank 0 and created by it. Collective."""
    staging = final.parent / comm.broadcast_object(f"{final.name}{STAGING}{uuid.uuid4().hex[:8]}")
    if comm.rank == 0:
        staging.mkdir(parents=True)
    return staging


def write_manifest(directory: Path, manifest: dict):
    """Written last, whole under another name and renamed, and fsynced with its directory: its
    presence marks the checkpoint complete (a reader never meets a manifest half written)."""
    partial = directory / PARTIAL_MANIFEST
    with open(partial, "w") as f:
        json.dump(with_digest(manifest), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, directory / MANIFEST)
    fsync_dir(directory)


def move_into_place(staging: Path, final: Path):
    """Rename the complete checkpoint to its name; an existing one is replaced only now.

    Replacing takes two renames (final -> final.old-*, staging -> final); a job killed between them
    leaves both complete copies beside an empty name, which `recover` puts back."""
    if final.exists():
        old = final.parent / f"{final.name}{REPLACED}{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(staging, final)
        remove_ours(old)
    else:
        os.replace(staging, final)
    fsync_dir(final.parent)


def remove_ours(directory: Path):
    """Delete a checkpoint's own files in `directory`, then the directory if that emptied it. Never
    follows a link; a file of anyone else's is left, with the directory, and named in a warning."""
    if not is_real_dir(directory):
        return
    for path in directory.iterdir():
        if is_ours(path):
            path.unlink()
    left = sorted(p.name for p in directory.iterdir())
    if left:
        log.warning("left %s in place: it holds files that are not a checkpoint's (%s)", directory, left[:5])
    else:
        directory.rmdir()


def locate(final) -> Path | None:
    """Where the checkpoint named `final` can be read, changing nothing (None: there is none).

    `final` itself when complete; when an interrupted save left it nameless, the complete copy it
    left (the new `.tmp-*` before the replaced `.old-*`), read where it lies. Readers (load,
    load_latest, load_params) only ever ask this: a `.tmp-*` with a manifest may be a live job's save
    a moment before its rename, which only that job may do (`recover` is the writer's)."""
    final = Path(final)
    if (final / MANIFEST).is_file():
        return final
    if final.exists() or final.is_symlink():
        return None
    complete = _complete_leftovers(final)
    newest = [p for p in complete if STAGING in p.name] or [p for p in complete if REPLACED in p.name]
    return newest[-1] if newest else None


def recover(final) -> Path | None:
    """Put a complete checkpoint back at `final` after a save was interrupted; returns where the
    checkpoint named `final` is now (None: there is none). A writer's step: save and save_step call
    it, holding the location's writer lock (checkpoint/lock.py), so no live save is taken for a dead one.

    Only ever renames; deletes nothing but a replaced copy (`.old-*`) proven superseded by a complete
    checkpoint at `final` (the newer one: the old copy is moved aside only once the new one is whole).
    If `final` is missing, the complete new copy (`.tmp-*` with a manifest) is preferred over the
    replaced old one. Not collective: rank 0 calls it."""
    final = Path(final)
    where = locate(final)
    if where == final:
        for old in _complete_leftovers(final):
            if REPLACED in old.name:
                remove_ours(old)
        return final
    if where is None:
        return None
    os.replace(where, final)
    log.warning("recovered %s from %s, left by an interrupted save", final, where.name)
    return final


def _complete_leftovers(final: Path) -> list[Path]:
    """The staging and replaced copies of `final` that hold a manifest, oldest first."""
    if not final.parent.is_dir():
        return []
    found = []
    for path in final.parent.glob(f"{glob.escape(final.name)}.*-*"):
        try:  # a live save may rename or remove it between the listing and this look
            found.append((path.stat().st_mtime, path))
        except FileNotFoundError:
            continue
    return [p for _, p in sorted(found) if is_real_dir(p) and (p / MANIFEST).is_file()]


def named_by(leftover: Path) -> str | None:
    """The checkpoint name a save's staging or replaced copy belongs to (`step-3.tmp-ab12` -> `step-3`)."""
    for suffix in (STAGING, REPLACED):
        if suffix in leftover.name:
            return leftover.name.split(suffix)[0]
    return None
