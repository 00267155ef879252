"""An optimizer's states in files on a local disk, a unit at a time in memory: DiskStates
(offload="disk").

Why: a rank keeps 16 bytes a parameter of its shards (masters, gradients, two Adam moments); the
moments are half of it and are touched once a step, by the update. In files under a directory the
user names (node-local scratch on a cluster), a model whose states exceed the node's memory trains:
the update holds one unit's moments at a time, in unit order, in one of two buffers a kind, while
a thread of its own reads the next unit's into the other and writes the last one back (pread and
pwrite release the interpreter: the I/O overlaps the update). The arithmetic is the in-memory
update's on the same values, so the bits are the same. A checkpoint reads and writes the states
through memory maps of the same files (`arrays`).

The files are the job's scratch, not the user's: one per state kind and rank, their space reserved
when made (posix_fallocate: a disk shared by a node's ranks fills at the start, not mid-step), and
unlinked at once (open files: they vanish when the process ends, however it ends). The directory is
held by a lock on this rank's owner file (flock: the kernel lets it go when the process dies), so a
directory another live job uses for this rank is refused, naming it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ALIGN = 4096  # each group's region starts on a page (its reads and writes whole pages of the file)


class DiskStates:
    """Each group's state arrays (the kinds an optimizer names: AdamW's exp_avg, exp_avg_sq) in files
    under `directory`, this rank's own. `arrays(i)` maps group i's (memmaps: writes go to the file);
    `streamed(indices)` hands them out one group at a time, the next read ahead."""

    def __init__(self, directory, kinds: tuple, groups: list, rank: int):
        self.directory, self.kinds = _usable(directory), tuple(kinds)
        arrays = [group.flat_param() for group in groups]
        self.dtype, self.counts = arrays[0].dtype, [a.size for a in arrays]
        sizes = [n * self.dtype.itemsize for n in self.counts]
        self.offsets = [int(o) for o in np.cumsum([0] + [-(-n // ALIGN) * ALIGN for n in sizes[:-1]])]
        self.file_bytes = self.offsets[-1] + sizes[-1]
        self.nbytes = len(self.kinds) * self.file_bytes
        self._files: dict = {}
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mpifsdp-offload")
        self._finalizer = weakref.finalize(self, _close, self._io, self._files)
        prefix = self.directory / f"rank-{rank:05d}"
        self._files["owner"] = _claim(prefix.with_suffix(".owner"), self.nbytes, self.directory)
        for kind in self.kinds:
            self._files[kind] = _reserved(prefix.with_suffix(f".{kind}"), self.file_bytes, self.directory)
        # two buffers a kind of the largest group's size: the one updated, the one read or written
        self.buffers = [
            {kind: np.empty(max(self.counts), self.dtype) for kind in self.kinds} for _ in range(2)
        ]
        self.buffer_bytes = 2 * len(self.kinds) * max(self.counts) * self.dtype.itemsize

    def arrays(self, i: int) -> dict:
        """kind -> group i's state as a memmap of its file region (read and written in place)."""
        return {
            kind: np.memmap(
                self._files[kind], self.dtype, "r+", offset=self.offsets[i], shape=(self.counts[i],)
            )
            for kind in self.kinds
        }

    def zero(self, i: int):
        """Group i's state back to zeros (as before its first step)."""
        for array in self.arrays(i).values():
            array[...] = 0

    def streamed(self, indices: list):
        """(i, group i's arrays) for each i in order, one group's state in memory at a time: the next
        group read into the other buffer while this one is updated, this one written back while the
        next is (one I/O thread, first in first out: a read into a buffer starts after the write from
        it). Run it out: its end waits for the writes."""
        buffers, writes = self.buffers, []
        read = self._io.submit(self._read, indices[0], buffers[0]) if indices else None
        for k, i in enumerate(indices):
            read.result()  # group i is in buffers[k % 2]
            if k + 1 < len(indices):
                read = self._io.submit(self._read, indices[k + 1], buffers[(k + 1) % 2])
            yield i, {kind: buffer[: self.counts[i]] for kind, buffer in buffers[k % 2].items()}
            writes.append(self._io.submit(self._write, i, buffers[k % 2]))
        for write in writes:
            write.result()

    def _read(self, i: int, buffers: dict):
        for kind in self.kinds:
            _whole(os.preadv, self._files[kind], buffers[kind], self.counts[i], self.offsets[i])

    def _write(self, i: int, buffers: dict):
        for kind in self.kinds:
            _whole(os.pwritev, self._files[kind], buffers[kind], self.counts[i], self.offsets[i])

    def remove(self):
        """The I/O thread stopped and the files closed (gone) now, else when this object is."""
        self._finalizer()


def _whole(transfer, file, buffer, count: int, offset: int):
    """`count` elements of `buffer` read or written at `offset` whatever a call moves at most (Linux:
    under 2 GiB a call)."""
    view, done = memoryview(buffer).cast("B")[: count * buffer.itemsize], 0
    while done < len(view):
        moved = transfer(file.fileno(), [view[done:]], offset + done)
        if moved <= 0:
            raise OSError(f"offload: {file.name} ended {len(view) - done} bytes early (was it changed?)")
        done += moved


def _usable(directory) -> Path:
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"offload_dir {str(directory)!r} is not a directory: create it first (node-local scratch on a "
            "cluster, e.g. $TMPDIR)"
        )
    return path


def _claim(owner: Path, nbytes: int, directory: Path):
    """This rank's owner file, opened and locked (returned: the lock lasts while it is open); another
    live process's lock refused, naming it, as is a directory with less free space than `nbytes`."""
    file = open(owner, "a+")  # noqa: SIM115 - held open for the lock's lifetime
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        said = file.read().strip() or "a process that has not written its name yet"
        file.close()
        raise ValueError(
            f"offload_dir {str(directory)!r} is in use for this rank by {said}: give each job (and each "
            "optimizer: del the old one first) a directory of its own"
        ) from None
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        file.close()
        raise ValueError(
            f"offload_dir {str(directory)!r} has {free / 2**30:.2f} GiB free; this rank's optimizer states "
            f"need {nbytes / 2**30:.2f} GiB there: free space, or name a larger disk"
        )
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID")}
    file.truncate(0)
    file.write(json.dumps(me))
    file.flush()
    return file


def _reserved(path: Path, nbytes: int, directory: Path):
    """A new file of `nbytes` zeros, its blocks reserved, opened and unlinked (gone with the process)."""
    file = open(path, "w+b")  # noqa: SIM115 - held open for the optimizer's lifetime
    path.unlink()
    try:
        os.posix_fallocate(file.fileno(), 0, max(nbytes, 1))
    except OSError as exc:
        file.close()
        raise ValueError(
            f"offload_dir {str(directory)!r}: reserving this rank's {nbytes / 2**30:.2f} GiB failed ({exc}); "
            "ranks of a node share its disk: free space, or name a larger disk"
        ) from None
    return file


def _close(io, files: dict):
    """Stop the I/O thread (a read under way finishes first), then close every file: the states'
    vanish (unlinked), the owner file's lock goes and the file itself is removed."""
    io.shutdown(wait=True)
    if "owner" in files:  # removed while still locked: no other process holds it in between
        Path(files["owner"].name).unlink(missing_ok=True)
    for file in files.values():
        file.close()


__all__ = ["DiskStates"]
