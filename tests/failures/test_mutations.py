"""Every safety mechanism has a test that fails when the mechanism is switched off.

For each mutant in tests/mutants/mutants.py this runs the tests named for it, in a fresh pytest
(under mpiexec when they need several ranks), with the mechanism switched off in every process, and
asserts that they fail. Collection errors and "no tests ran" do not count as caught.
"""

import os
import re
import sys

import pytest

from support import ROOT, mpiexec, require, run_launched

sys.path.insert(0, str(ROOT / "tests" / "mutants"))
from mutants import MUTANTS  # noqa: E402

TESTS = ROOT / "tests"


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_switching_a_mechanism_off_fails_its_test(comm, name):
    if comm.size > 1:
        pytest.skip("drives its own pytest runs: runs in the plain-pytest pass of make test")
    mutant = MUTANTS[name]
    pythonpath = os.pathsep.join(filter(None, [str(TESTS / "mutants"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "MPIFSDP_MUTANT": name, "MPIFSDP_TIMEOUT": "10"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi", *mutant.tests]
    if mutant.ranks > 1:
        command = [*mpiexec(), "-n", str(mutant.ranks), sys.executable, "-m", "mpi4py", *command[1:]]
    result = run_launched(command, cwd=TESTS.parent, env=env, timeout=300)
    output = result.stdout + result.stderr
    # Caught: tests failed (under mpiexec, a failed test aborts the job: conftest.py; or the watchdog
    # ended it). Not caught: exit 0, or a
    # run that proves nothing (exit 2, 4, 5: interrupted, usage error, no tests collected; errors
    # in setup or collection).
    caught = result.returncode not in (0, 2, 4, 5) and re.search(
        r"\d+ failed|mpifsdp watchdog|mpifsdp tests: FAILED", output
    )
    lacked = re.search(r"not checked on this machine \(\d+\)\W*\n\s*(.+)", output)
    if not caught and lacked and not re.search(r"\d+ passed", output):  # it asked; this machine lacks it
        require(f"the test of the {mutant.mechanism} could not run: {lacked[1]}")
    assert caught and not re.search(r"\d+ errors? in ", output), (
        f"with the {mutant.mechanism} switched off, {mutant.tests} did not fail (exit {result.returncode}):\n"
        + output[-3000:]
    )
