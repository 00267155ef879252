"""Files that appear whole or not at all: written under a temporary name beside the target, fsynced,
renamed over it, and the directory fsynced so that the rename itself survives a crash. Every file
mpifsdp writes goes through here (checkpoint directories through checkpoint/publish.py, which uses
the same fsync_dir)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from pathlib import Path

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a scheduler's kill, a closed terminal
_in_progress: list[Path] = []  # temporary files to remove if one of those ends the process
_previous_handlers: dict[int, object] = {}


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
def removed_if_terminated(tmp: Path):
    """While the block runs, SIGTERM or SIGHUP removes `tmp` before the process ends as that signal
    would have ended it (a killed export must not leave a hidden copy of the model's size in the
    user's directory; SIGINT already raises KeyboardInterrupt, which the caller's cleanup sees).

    Only where the signal would end the process: a signal ignored (nohup) is left ignored, and a
    handler of the caller's (a graceful stop on a scheduler's warning) runs instead, the write going
    on if it returns (if it raises, the caller's cleanup sees the exception). Signal handlers belong
    to the main thread: elsewhere this only tracks nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _in_progress:
        for number in ENDING_SIGNALS:
            if _ends_the_process(signal.getsignal(number)):
                _previous_handlers[number] = signal.signal(number, _remove_then_end)
    _in_progress.append(Path(tmp))
    try:
        yield
    finally:
        _in_progress.remove(Path(tmp))
        if not _in_progress:
            for number, handler in _previous_handlers.items():
                signal.signal(number, handler)
            _previous_handlers.clear()


def _ends_the_process(handler) -> bool:
    """Whether a signal with this disposition ends the process: the default's; not SIG_IGN, not a
    Python handler of the caller's, and not one set outside Python (None: its effect is unknown,
    and replacing it could not put it back)."""
    return handler == signal.SIG_DFL


def _remove_then_end(number, frame):
    for tmp in _in_progress:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    signal.signal(number, signal.SIG_DFL)  # end the process as the signal does
    os.kill(os.getpid(), number)


@contextlib.contextmanager
def atomic_file(path):
    """`with atomic_file(path) as f:` writes f (binary) whole over `path` at the end of the block, or
    not at all: an exception leaves `path` as it was and removes the temporary file."""
    path = Path(path)
    tmp = temporary_name(path)
    with removed_if_terminated(tmp):
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            replace_durably(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
