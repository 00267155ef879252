"""An optimizer's states in files on a local disk, a unit at a time: DiskStates (offload="disk").

Why: a rank keeps 16 bytes a parameter of its shards (masters, gradients, two Adam moments); the
moments are half of it and are touched once a step, by the update. In memory-mapped files under a
directory the user names (node-local scratch on a cluster), a model whose states exceed the node's
memory trains: the update maps one unit's moments at a time, in unit order, while the kernel reads
the next unit's ahead (posix_fadvise WILLNEED) and writes the last one's back as it needs the pages.
The arithmetic is the in-memory update's on the same values, so the bits are the same.

The files are the job's scratch, not the user's: one per state kind and rank (`rank-00000.exp_avg`),
made sparse (zeros, as a first step's moments are), removed when the optimizer goes (or the
interpreter exits). A directory another live job holds (its owner file names a process alive on
this host, or another host) is refused, as is one with less free space than the files need.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ALIGN = 4096  # each group's region starts on a page: a mapping's offset must be a multiple of it


class DiskStates:
    """Each group's state arrays (the kinds an optimizer names: AdamW's exp_avg, exp_avg_sq) in files
    under `directory`, this rank's own. `arrays(i)` maps group i's (memmaps: writes go to the file);
    `streamed(indices)` maps them one group at a time, the next read ahead."""

    def __init__(self, directory, kinds: tuple, groups: list, rank: int):
        self.directory, self.kinds = _usable(directory), tuple(kinds)
        arrays = [group.flat_param() for group in groups]
        self.dtype = arrays[0].dtype
        sizes = [a.size * self.dtype.itemsize for a in arrays]
        self.offsets = list(np.cumsum([0] + [-(-n // ALIGN) * ALIGN for n in sizes[:-1]]))
        self.counts = [a.size for a in arrays]
        self.nbytes = len(self.kinds) * (int(self.offsets[-1]) + sizes[-1])
        prefix = self.directory / f"rank-{rank:05d}"
        self.owner = prefix.with_suffix(".owner")
        self.paths = {kind: prefix.with_suffix(f".{kind}") for kind in self.kinds}
        _claim(self.owner, self.nbytes, self.directory)
        for path in self.paths.values():  # sparse: zeros, no bytes written
            with open(path, "wb") as f:
                f.truncate(self.nbytes // len(self.kinds))
        self._fds = {kind: os.open(path, os.O_RDWR) for kind, path in self.paths.items()}
        self._thread = None  # the I/O thread, made at the first step
        # two buffers a kind of the largest group's size: the one updated, the one read or written
        self.buffers = [
            {kind: np.empty(max(self.counts), self.dtype) for kind in self.kinds} for _ in range(2)
        ]
        self.buffer_bytes = 2 * len(self.kinds) * max(self.counts) * self.dtype.itemsize
        self._finalizer = weakref.finalize(
            self, _close, list(self._fds.values()), [self.owner, *self.paths.values()]
        )

    def arrays(self, i: int) -> dict:
        """kind -> group i's state as a memmap of its file region (read and written in place)."""
        return {
            kind: np.memmap(path, self.dtype, "r+", offset=int(self.offsets[i]), shape=(self.counts[i],))
            for kind, path in self.paths.items()
        }

    def zero(self, i: int):
        """Group i's state back to zeros (as before its first step)."""
        for array in self.arrays(i).values():
            array[...] = 0

    def streamed(self, indices: list):
        """(i, group i's arrays) for each i in order, one group's state in memory at a time (two
        buffers a kind, the largest group's size): the next group read into the other buffer, and
        this one written back after its update, by a thread of I/O while the caller computes
        (pread/pwrite release the interpreter), in file order."""
        if not indices:
            return
        io = self._io()
        buffers = self.buffers
        pending = io.submit(self._read, indices[0], buffers[0])
        for k, i in enumerate(indices):
            pending.result()  # group i is in buffers[k % 2] (and the writes before it done)
            if k + 1 < len(indices):  # after the write of group k-1, which used the other buffer
                pending = io.submit(self._read, indices[k + 1], buffers[(k + 1) % 2])
            state = {kind: buffer[: self.counts[i]] for kind, buffer in buffers[k % 2].items()}
            yield i, state
            written = io.submit(self._write, i, buffers[k % 2])
            if k + 1 == len(indices):
                written.result()
            else:
                pending = _after(pending, written)

    def _io(self):
        """The one thread that reads and writes the files (made at the first step)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="mpifsdp-offload")
        return self._thread

    def _read(self, i: int, buffers: dict):
        nbytes = self.counts[i] * self.dtype.itemsize
        for kind, fd in self._fds.items():
            view = memoryview(buffers[kind]).cast("B")[:nbytes]
            if os.preadv(fd, [view], int(self.offsets[i])) != nbytes:
                raise OSError(
                    f"offload: a short read of {self.paths[kind]} (was it changed by another process?)"
                )

    def _write(self, i: int, buffers: dict):
        nbytes = self.counts[i] * self.dtype.itemsize
        for kind, fd in self._fds.items():
            view = memoryview(buffers[kind]).cast("B")[:nbytes]
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, view[done:], int(self.offsets[i]) + done)

    def remove(self):
        """The files gone now (else when this object is, or the interpreter exits)."""
        self._finalizer()


def _usable(directory) -> Path:
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"offload_dir {str(directory)!r} is not a directory: create it first (node-local scratch on a "
            "cluster, e.g. $TMPDIR)"
        )
    return path


def _claim(owner: Path, nbytes: int, directory: Path):
    """Write this process's owner file, refusing a directory another live job holds for this rank or
    one with less free space than `nbytes`."""
    held = _holder(owner)
    if held is not None:
        raise ValueError(
            f"offload_dir {str(directory)!r} holds rank files of another job ({held}): give each job a "
            "directory of its own (its states would overwrite the other's)"
        )
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise ValueError(
            f"offload_dir {str(directory)!r} has {free / 2**30:.2f} GiB free; this rank's optimizer states "
            f"need {nbytes / 2**30:.2f} GiB there: free space, or name a larger disk"
        )
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID")}
    owner.write_text(json.dumps(me))


def _holder(owner: Path) -> str | None:
    """Who holds `owner` if a live process does (this host: its pid alive; another host: taken as
    alive, as nothing here can ask it), else None (none, or a job that ended without removing it)."""
    try:
        held = json.loads(owner.read_text())
    except (OSError, ValueError):
        return None
    said = f"pid {held.get('pid')} on {held.get('host')}" + (
        f", Slurm job {held['job']}" if held.get("job") else ""
    )
    if held.get("host") != socket.gethostname():
        return said
    if held.get("pid") == os.getpid():
        return said + ": an optimizer of this process already offloads there"
    try:
        os.kill(int(held["pid"]), 0)
    except (ProcessLookupError, KeyError, TypeError, ValueError):
        return None
    except PermissionError:
        return said
    return said


def _after(read, written):
    """A future done when both are (the next read, then the write before it, on the one I/O thread:
    the read's buffer was the write's)."""
    return _Both(read, written)


class _Both:
    def __init__(self, *futures):
        self.futures = futures

    def result(self):
        for future in self.futures:
            future.result()


def _close(fds: list, paths: list):
    for fd in fds:
        os.close(fd)
    _remove(paths)


def _remove(paths: list):
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


__all__ = ["DiskStates"]
