"""A report written just before MPI_Abort reaches the user: the abort waits until the launcher has read it."""

import os
import select
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mpifsdp.comm import presence

REPORTS_THEN_ABORTS = textwrap.dedent(
    """
    import sys, time
    from mpifsdp.comm.presence import report_and_abort

    def abort(code):
        print(f"aborted at {time.monotonic()!r} with {code}", flush=True)

    report_and_abort("mpifsdp watchdog: the report", abort, 3)
    """
)


def test_the_abort_comes_only_after_the_launcher_has_read_the_report(comm):
    """A 4-rank watchdog job lost most of its reports (once in CI, all four): MPI_Abort tore down the
    launcher while they were still in the pipe. Here the "launcher" reads the pipe 0.5 s late; the
    abort must come after that read, and the report must be whole."""
    if comm.size > 1:
        pytest.skip("starts its own process: runs in the plain-pytest pass of make test")
    child = subprocess.Popen(
        [sys.executable, "-c", REPORTS_THEN_ABORTS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # the report is in the pipe (however long the child took to start): the launcher reads 0.5 s late
    assert select.select([child.stderr], [], [], 60)[0], "the child wrote no report"
    time.sleep(0.5)
    read_at = time.monotonic()
    report = child.stderr.readline()  # the pipe's whole content: the child wrote one line
    out, _ = child.communicate(timeout=60)
    aborted_at = float(out.split()[2])  # CLOCK_MONOTONIC: one clock for every process of this machine
    assert report == "mpifsdp watchdog: the report\n"
    assert aborted_at > read_at, f"the abort came {read_at - aborted_at:.2f} s before the report was read"
    assert out.endswith("with 3\n")


def test_a_report_nobody_reads_delays_the_abort_by_READ_S_at_most(monkeypatch):
    """A launcher that never reads (gone already) must not keep the job from ending."""
    monkeypatch.setattr(presence, "READ_S", 0.2)
    read, write = os.pipe()
    try:
        os.write(write, b"a report nobody reads\n")
        start = time.monotonic()
        presence.wait_until_read(write)
        assert 0.2 <= time.monotonic() - start < 0.2 + presence.FORWARD_S + 1.0
    finally:
        os.close(read)
        os.close(write)


def test_a_report_read_in_time_ends_the_wait_when_it_is_read():
    read, write = os.pipe()
    reader = threading.Timer(0.3, os.read, (read, 4096))
    try:
        os.write(write, b"x" * 1000)
        start = time.monotonic()
        reader.start()
        presence.wait_until_read(write)
        elapsed = time.monotonic() - start
        assert 0.3 <= elapsed < presence.READ_S, elapsed
    finally:
        reader.join()
        os.close(read)
        os.close(write)


def test_stderr_that_is_no_pipe_is_not_waited_for(tmp_path):
    """A terminal or a file holds nothing back: no pause before the abort."""
    with open(tmp_path / "stderr.txt", "w") as file:
        start = time.monotonic()
        presence.wait_until_read(file.fileno())
        assert time.monotonic() - start < presence.FORWARD_S


def test_the_roll_call_blames_a_mismatch_only_where_the_ranks_wait_in_different_collectives():
    """Every rank answering from the watchdog's own collective was reported as "collectives that do not
    match": any slow collective got that false diagnosis."""
    from mpifsdp.comm.presence import roll_call_verdict

    same = "all-reduce of a step (#12, 1 float64)"
    said = roll_call_verdict({1: same, 2: same}, [], same)
    assert "waits in this same collective: it is slow, not mismatched" in said and "do not match" not in said
    said = roll_call_verdict({1: same, 2: "gather of blocks.0 (forward)"}, [], same)
    assert "they wait in collectives that do not match" in said
    said = roll_call_verdict({1: same}, [2], same)
    assert "rank(s) [2] did not answer" in said and "rank 1 waits in all-reduce of a step" in said
