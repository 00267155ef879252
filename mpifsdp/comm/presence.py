"""Who is still here: the ranks' side channel for an exit handshake and the watchdog's roll call.

A rank that leaves early (its script ended, `sys.exit`, an uncaught exception without
`python -m mpi4py`, a time budget that ran out sooner) left the others blocked in their next
collective until the watchdog fired (300 s). So each rank of the first Comm made over several ranks
says, at exit, that it leaves and why (the exception that ended it, if one did) and where (its last
collective), then waits for every rank to leave too: at the normal end of a program all do at once
and this takes milliseconds. A rank still running finds the notice while it waits for a collective
(Schedule.wait polls here) and ends the job at once, naming the rank that left and where. A rank an
exception ended, with no `-m mpi4py` to abort the job for it, ends the job itself a few seconds on
unless the others have left too or ended it first: they may be at work, in no collective, for long.

When the watchdog fires, the rank asks every other rank where it is (a roll call) and reports which
ranks wait in a collective, and where, and which did not answer: those are the ones missing from the
collective (frozen, blocked outside mpifsdp, or dead), not the ones that had no time to print.
Messages travel on a Dup of the Comm's communicator: they can never match anyone else's.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import os
import stat
import sys
import termios
import time
import traceback

import numpy as np

LEFT, ROLL, HERE = 7301, 7302, 7303  # tags: a rank left; where are you?; here I am
MESSAGE_BYTES = 1024
GRACE_S = 2.0  # how long a collective may still complete after a notice, and a roll call waits
READ_S = 2.0  # how long a report may wait for the launcher to read it before the job is aborted
FORWARD_S = 0.1  # and how long the launcher then gets to pass it on
EXIT_WAIT_S = 3 * GRACE_S  # how long a rank an exception ended waits for the others to end the job
_channel = None  # this process's Channel, made by the first Comm over several ranks


def open_channel(mpi_comm, where, timeout: float):
    """Start the side channel over `mpi_comm` (once per process: the first Comm over several ranks,
    usually the world's; the ranks of a Comm made over some of them first, as a code that splits the
    job into independent groups does, watch each other). where(): this rank's position (the
    collective it is in, or its last one); timeout: after how long a rank waiting at exit says so."""
    global _channel
    if _channel is None and mpi_comm.Get_size() > 1:
        _channel = Channel(mpi_comm, where, timeout)


def waiting_in(where):
    """A Comm waits for a collective: reports name its position (with several Comms, the latest to
    wait, not the first made), and a sys.excepthook the program set since is wrapped, so that an
    exception ending this rank is still said to the others (it read as "its program ended")."""
    if _channel is not None:
        _channel.where = where
        if sys.excepthook is not _channel.excepthook:
            _channel.wrap_excepthook()


def check(request):
    """Called while `request` (a collective) is awaited: answer a roll call; end the job if another
    rank has left and the collective does not complete within GRACE_S (one of its ranks is gone)."""
    if _channel is not None:
        _channel.check(request)


def roll_call() -> str:
    """Where every other rank is, as far as they answer within GRACE_S (for the watchdog's report)."""
    return _channel.roll_call() if _channel is not None else ""


def roll_call_verdict(answered: dict, silent: list, mine: str) -> str:
    """The roll call in words: where each rank that answered waits, and who is to blame. Ranks that
    did not answer are missing from the collective; where all wait in the watchdog's own collective,
    it is slow (nothing is mismatched: the report said so, falsely, of any slow collective)."""
    waiting = "; ".join(f"rank {r} waits in {where}" for r, where in sorted(answered.items()))
    if silent:
        missing = (
            f"rank(s) {silent} did not answer within {GRACE_S:.0f} s: they are the ones missing from "
            "the collective (frozen, blocked outside mpifsdp's collectives, or dead)"
        )
    elif set(answered.values()) <= {mine}:
        missing = (
            "every rank answered and waits in this same collective: it is slow, not mismatched (a slow "
            "or stuck link, or more data than the timeout allows for)"
        )
    else:
        missing = "every rank answered: they wait in collectives that do not match"
    return f"{waiting + '. ' if waiting else ''}{missing}."


def report_and_abort(text: str, abort, code: int):
    """Write `text` to stderr in one write, then end the job (`abort(code)`: MPI_Abort) once the
    launcher has read it. The abort tears the launcher's forwarding down, and a report still in the
    pipe was lost with it: a 4-rank watchdog job printed one or two of its four reports in most runs
    and, once in CI, none at all."""
    sys.stderr.flush()  # what the program wrote before stays before the report
    os.write(2, (text + "\n").encode(errors="replace"))
    wait_until_read(2)
    abort(code)


def wait_until_read(fd: int):
    """Return once what this process wrote to `fd` has left its pipe (the launcher reads the other
    end; at most READ_S), and the launcher has had FORWARD_S to pass it on. Not a pipe (a terminal,
    a file): nothing is waiting to be read, and this returns at once."""
    try:
        piped = stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:  # closed
        return
    if not piped:
        return
    unread, deadline = array.array("i", [0]), time.monotonic() + READ_S
    while time.monotonic() < deadline:
        fcntl.ioctl(fd, termios.FIONREAD, unread)  # bytes in the pipe, whichever end asks
        if unread[0] == 0:
            break
        time.sleep(0.01)
    time.sleep(FORWARD_S)


def _encode(text: str) -> np.ndarray:
    raw = text.encode()[:MESSAGE_BYTES]
    message = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
    message[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return message


def _decode(message: np.ndarray) -> str:
    return message.tobytes().rstrip(b"\0").decode(errors="replace")


class Channel:
    def __init__(self, mpi_comm, where, timeout: float):
        from mpi4py import MPI

        self.mpi, self.comm = MPI, mpi_comm.Dup()
        self.rank, self.size, self.where, self.timeout = (
            self.comm.Get_rank(),
            self.comm.Get_size(),
            where,
            timeout,
        )
        self.why, self.failed = "its program ended", False
        # a rank as reports name it: its rank in the job (MPI_COMM_WORLD), where the channel runs over
        # a communicator of some of the ranks
        world = MPI.COMM_WORLD.Get_group()
        self.named = MPI.Group.Translate_ranks(self.comm.Get_group(), list(range(self.size)), world)
        # (request, message) of sends never waited for (roll calls and their answers: small, sent
        # eagerly); each message is kept with its request, as MPI may read it until it completes
        self._sends = []
        self.excepthook = self._excepthook  # bound once: `sys.excepthook is self.excepthook` holds
        self.wrap_excepthook()
        atexit.register(self.leave)

    def wrap_excepthook(self):
        """Note an exception that ends this rank, then hand it to the hook that was there."""
        self._previous_hook = sys.excepthook
        sys.excepthook = self.excepthook

    def _excepthook(self, kind, value, tb):
        again, self.failed = self.failed, True
        self.why = f"an exception ended it: {kind.__name__}: {value}"
        if self._previous_hook is not sys.__excepthook__ and not again:
            # a hook of the program's that hands on to the one it found (ours, wrapped again since)
            # comes back here once: from then on the traceback is printed below
            self._previous_hook(kind, value, tb)
            return
        # One write: every rank printing the same traceback line by line interleaved them
        # ("NonFiniteErrorNonFiniteError: : ..."), and a pipe keeps a single write of it whole.
        os.write(2, "".join(traceback.format_exception(kind, value, tb)).encode(errors="replace"))
        wait_until_read(2)  # `-m mpi4py` aborts the job as soon as this returns

    def _probe(self, tag):
        status = self.mpi.Status()
        return status if self.comm.Iprobe(source=self.mpi.ANY_SOURCE, tag=tag, status=status) else None

    def _receive(self, status) -> str:
        message = np.empty(MESSAGE_BYTES, dtype=np.uint8)
        self.comm.Recv(message, source=status.Get_source(), tag=status.Get_tag())
        return _decode(message)

    def _answer_roll_calls(self, where: str):
        while (asked := self._probe(ROLL)) is not None:
            self._receive(asked)
            message = _encode(where)
            self._sends.append((self.comm.Isend(message, dest=asked.Get_source(), tag=HERE), message))

    def check(self, request):
        self._answer_roll_calls(self.where())  # a watchdog elsewhere asks: say where this rank waits
        left = self._probe(LEFT)
        if left is None:
            return
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:  # left right after this very collective: it completes here
            if request.Test():
                return  # the notice stays queued: leave() receives it at this rank's own exit
            time.sleep(1e-3)
        why = self._receive(left)
        self._end(
            f"mpifsdp: rank {self.named[left.Get_source()]} left the job ({why}) while rank "
            f"{self.named[self.rank]} waited in {self.where()}: ending the job (every rank must run the same "
            "collectives to the end)"
        )

    def roll_call(self) -> str:
        message = _encode("roll call")
        sends = [self.comm.Isend(message, dest=r, tag=ROLL) for r in range(self.size) if r != self.rank]
        answers, deadline = {}, time.monotonic() + GRACE_S
        while len(answers) < self.size - 1 and time.monotonic() < deadline:
            self._answer_roll_calls(self.where())  # the others' watchdogs may be asking at once
            if (status := self._probe(HERE)) is not None:
                answers[status.Get_source()] = self._receive(status)
            else:
                time.sleep(1e-3)
        self._sends += [(send, message) for send in sends]  # the silent ranks never receive theirs
        answered = {self.named[r]: where for r, where in answers.items()}
        silent = [self.named[r] for r in range(self.size) if r != self.rank and r not in answers]
        return roll_call_verdict(answered, silent, self.where())

    def leave(self):
        """At exit: tell every other rank, then wait until every rank has left. No deadline: a rank
        still at work (rank 0 writing a report alone) is not stuck, and one that enters a collective
        finds the notice and ends the job; after `timeout` seconds this rank says once that it waits."""
        message = _encode(f"{self.why}; its last collective: {self.where()}")
        sends = [self.comm.Isend(message, dest=r, tag=LEFT) for r in range(self.size) if r != self.rank]
        if self.failed:  # an exception: `-m mpi4py` aborts the job next, and must not be delayed
            self._sends += [(send, message) for send in sends]  # in flight past this function
            if "mpi4py.run" not in sys.modules:
                self._end_unless_all_left()
            return
        everyone = self.comm.Ibarrier()
        said = time.monotonic() + self.timeout
        while not everyone.Test():
            self._answer_roll_calls(f"its exit (it ended its program; its last collective: {self.where()})")
            if time.monotonic() > said:
                sys.stderr.write(
                    f"mpifsdp: rank {self.named[self.rank]} ended its program and waits for the others "
                    "to end\n"
                )
                sys.stderr.flush()
                said = float("inf")
            time.sleep(1e-3)
        received = np.empty(MESSAGE_BYTES, dtype=np.uint8)
        for _ in range(self.size - 1):  # every rank posted one notice to each other before the barrier
            self.comm.Recv(received, source=self.mpi.ANY_SOURCE, tag=LEFT)
        self.mpi.Request.Waitall(sends)

    def _end_unless_all_left(self):
        """A failed rank launched without `-m mpi4py`: nothing aborts the job for it, and a rank that
        does not reach a collective soon (at work, or blocked outside mpifsdp's collectives) would
        keep the job alive. Wait EXIT_WAIT_S for every other rank's notice (all failed, or ended:
        the job ends as they exit), for one of them to end the job, naming this rank; else end it."""
        left, deadline = set(), time.monotonic() + EXIT_WAIT_S
        while len(left) < self.size - 1 and time.monotonic() < deadline:
            self._answer_roll_calls(f"its exit ({self.why})")
            if (status := self._probe(LEFT)) is not None:
                self._receive(status)
                left.add(status.Get_source())
            else:
                time.sleep(1e-3)
        if len(left) < self.size - 1:
            self._end(
                f"mpifsdp: rank {self.named[self.rank]} left the job ({self.why}) and no other rank ended "
                f"the job within {EXIT_WAIT_S:.0f} s: ending it"
            )

    def _end(self, text: str):
        report_and_abort(text, self.comm.Abort, 1)
